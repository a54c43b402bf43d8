cd /work/main; . .venv/bin/activate
echo "many4 load $(cut -d' ' -f1 /proc/loadavg)"; flock /tmp/bench.lock python bench/bench_many_workers.py --cases async --shards 4 --rate-mbit auto --seconds 60 --out /tmp/w45/user/many4 > /tmp/w45/user/many4.log 2>&1; tail -n 5 /tmp/w45/user/many4.md
echo "keras load $(cut -d' ' -f1 /proc/loadavg)"; flock /tmp/bench.lock python bench/bench_keras_netns.py --workers 8 --shards 4 --modes async,sync --ring 8 --rate-mbit 50 --epochs 6 --no-local --out /tmp/w45/user/keras > /tmp/w45/user/keras.log 2>&1; tail -n 8 /tmp/w45/user/keras.md
