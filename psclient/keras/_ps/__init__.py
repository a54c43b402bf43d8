"""Parameter-server training for ``model.fit`` and ``GradientTape`` loops (Keras 3 glue).

An existing ``model.fit`` script becomes parameter-server trained by three changes,
in the spirit of Horovod's ``DistributedOptimizer``::

    import psclient.keras as psk

    worker = psk.PSWorker(["ps0:50051", "ps1:50051"])        # index and count from TF_CONFIG, or
    # worker = psk.PSWorker([...], worker_index=1, num_workers=2)
    model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adam(1e-3), worker),  # 1
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(ds, epochs=5, callbacks=[worker.callback()])                               # 2

and for a custom ``GradientTape`` loop::

    worker.attach(model, optimizer=keras.optimizers.Adam(1e-3))
    for x, y in ds:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        worker.apply_gradients(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    worker.finish()

How it works:

- All of a model's state lives on the shards, under names relative to the model
  (``psclient.keras.model_variable_names``: the same for every copy of the model
  in any process). Trainable variables are updated by the server-side optimizer
  built from the Keras optimizer's configuration. Non-trainable floating-point
  state (BatchNorm moving statistics, the weights of frozen layers) is shared too:
  each step, the change a worker's forward pass made to it (``new - old``) is
  added to the shard's value (in sync mode, the mean of the step's changes), and
  the worker continues from the shard's value. Frozen weights never change, so
  they cost nothing after the first pull. Random generators' states stay local.
- The chief (worker 0) creates the variables; the other workers wait for them and
  attach (idempotently: a restarted worker attaches again). Every worker then
  starts from the shards' values. Variables an optimizer sees first in the train
  step (a GAN's two optimizers, a layer unfrozen before a second ``fit``) are
  attached when it first applies them.
- Each step pushes the gradients and receives new values. The exchange is host
  code inside Keras's compiled train step, staged by the backend's adapter
  (``psclient.keras._backend``): a ``tf.numpy_function`` on TensorFlow (``fit``
  keeps ``tf.function``; XLA ``jit_compile`` must be off), an ordered
  ``io_callback`` in the jitted stateless step on JAX (``fit`` stays compiled),
  a direct call in PyTorch's eager step. This module imports no TensorFlow.
- ``async`` and ``ssp`` modes can overlap communication with compute
  (``overlap=True``): step ``k``'s fused ``push_pull`` is in flight while step
  ``k + 1`` computes, on the values returned by step ``k - 1``'s ``push_pull``
  (one step of extra staleness; off by default). ``sync`` mode pushes with the global step
  (the push is the barrier), then pulls the step's result; a worker whose
  gradient was dropped as stale resyncs to the shards' current step.
- Worker side (as Keras does them): ``global_clipnorm`` (it needs all of a step's
  gradients), ``gradient_accumulation_steps`` (one push per k steps), loss scaling
  (``LossScaleOptimizer`` / ``mixed_float16``). Shard side: the update rule,
  learning-rate schedules (evaluated from each variable's update count),
  ``weight_decay``, ``clipnorm`` and ``clipvalue``. A learning rate set by a
  callback (``LearningRateScheduler``, ``ReduceLROnPlateau``) is sent to the shards
  before the next step.

Modules (one seam each): ``worker`` (``PSWorker``: its state, finish and close; made of the
``setup`` and ``step`` mixins), ``setup`` (attach: create or find the variables and tables,
learning rates, the end of a ``fit``), ``step`` (one step's exchange and ``apply_gradients``),
``optimizer`` (``DistributedOptimizer``, ``server_optimizer``), ``callbacks`` (``PSCallback``,
``load_from_ps``).
"""

from psclient.keras._ps.callbacks import PSCallback, load_from_ps
from psclient.keras._ps.optimizer import DistributedOptimizer, server_optimizer
from psclient.keras._ps.setup import STATE_OPTIMIZER
from psclient.keras._ps.worker import MODES, PSWorker

__all__ = [
    "MODES", "STATE_OPTIMIZER", "DistributedOptimizer", "PSCallback", "PSWorker", "load_from_ps",
    "server_optimizer",
]  # fmt: skip
