#!/usr/bin/env bash
# How docs/mlflow-ui.png was made: a real quickstart run, `keras-sync ui`, headless Chromium.
# Needs Debian's chromium (apt-get install chromium). Run from the repo root.
set -euo pipefail
work=$(mktemp -d); cd "$work"
"$OLDPWD/.venv/bin/python" "$OLDPWD/examples/quickstart.py" --epochs 3
"$OLDPWD/.venv/bin/keras-sync" ui --port 5055 --no-browser & ui=$!
trap 'kill $ui' EXIT
until curl -sf -o /dev/null http://127.0.0.1:5055/; do sleep 1; done
run=$("$OLDPWD/.venv/bin/python" -c "from mlflow import MlflowClient; c = MlflowClient('sqlite:///$work/mlflow.db'); print(c.search_runs(['1'])[0].info.run_id)")
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$work/chrome" --window-size=1500,2000 \
  --virtual-time-budget=25000 --screenshot="$OLDPWD/docs/mlflow-ui.png" \
  "http://127.0.0.1:5055/#/experiments/1/runs/$run/model-metrics"
# The replicas' losses on one chart: MLflow's metric page takes the metrics it overlays from its URL.
keys=$("$OLDPWD/.venv/bin/python" -c "
import json; from mlflow import MlflowClient
c = MlflowClient('sqlite:///$work/mlflow.db'); run = c.get_run('$run')
print(json.dumps(sorted(k for k in run.data.metrics if k.startswith('sync/loss/replica_'))))")
first=$("$OLDPWD/.venv/bin/python" -c "import json; print(json.loads('$keys')[0])")
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$work/chrome" --window-size=1500,1000 \
  --virtual-time-budget=25000 --screenshot="$OLDPWD/docs/mlflow-replicas.png" \
  "http://127.0.0.1:5055/#/metric/$first?runs=[\"$run\"]&metric=\"$first\"&experiments=[\"1\"]&plot_metric_keys=$keys"
