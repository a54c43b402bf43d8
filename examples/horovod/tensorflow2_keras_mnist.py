# Port of Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py (horovod/horovod@2626dc8) to
# psclient.horovod; run it with `psrun -np 2 python examples/horovod/tensorflow2_keras_mnist.py`.
# ruff: noqa: E501, I001, UP031 - Horovod's code kept as published, so the diff stays the changed lines
#
# Changed lines (everything else is Horovod's):
#   imports:  `import horovod` -> `import psclient.horovod as horovod`;
#             `import horovod.tensorflow.keras as hvd` -> `import psclient.horovod.keras as hvd`;
#             + `import os` and `import digits_mnist` (below).
#   dataset:  `tf.keras.datasets.mnist.load_data(...)` -> `digits_mnist.load_data(...)` (no network here:
#             scikit-learn's digits scaled and padded to 28x28, the same arrays and dtypes as MNIST's).
#   Keras 3:  `experimental_run_tf_function=False` removed from `compile` (Keras 3 has no such argument);
#             the checkpoint `./checkpoint-{epoch}.h5` -> `./checkpoint-{epoch}.keras` (the Keras 3 format).
#   length:   `steps_per_epoch=500 // hvd.size()` -> `int(os.environ.get('STEPS_PER_EPOCH', 500)) // hvd.size()` and
#             `epochs=24` -> `epochs=int(os.environ.get('EPOCHS', 24))`: same defaults, smaller in the tests
#             (a test run must take < 60 s on 2 CPU cores).
# Copyright 2019 Uber Technologies, Inc. All Rights Reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================

import os
import sys

import tensorflow as tf

import digits_mnist
import psclient.horovod as horovod
import psclient.horovod.keras as hvd


def main():
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    (mnist_images, mnist_labels), _ = digits_mnist.load_data(path="mnist-%d.npz" % hvd.rank())

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(mnist_labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(128)

    mnist_model = tf.keras.Sequential(
        [
            tf.keras.layers.Conv2D(32, [3, 3], activation="relu"),
            tf.keras.layers.Conv2D(64, [3, 3], activation="relu"),
            tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
            tf.keras.layers.Dropout(0.25),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dropout(0.5),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    # Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
    # uses hvd.DistributedOptimizer() to compute gradients.
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"])

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average metrics among workers at the end of every epoch.
        #
        # Note: This callback must be in the list before the ReduceLROnPlateau,
        # TensorBoard or other metrics-based callbacks.
        hvd.callbacks.MetricAverageCallback(),
        # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
        # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
        # the first three epochs. See https://arxiv.org/abs/1706.02677 for details.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint("./checkpoint-{epoch}.keras"))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    mnist_model.fit(
        dataset,
        steps_per_epoch=int(os.environ.get("STEPS_PER_EPOCH", 500)) // hvd.size(),
        callbacks=callbacks,
        epochs=int(os.environ.get("EPOCHS", 24)),
        verbose=verbose,
    )


if __name__ == "__main__":
    if len(sys.argv) == 4:
        # run training through horovod.run
        np = int(sys.argv[1])
        hosts = sys.argv[2]
        comm = sys.argv[3]
        print("Running training through horovod.run")
        horovod.run(main, np=np, hosts=hosts, use_gloo=comm == "gloo", use_mpi=comm == "mpi")
    else:
        # this is running via horovodrun
        main()
