#!/usr/bin/env bash
# Bring the results of bench/device_check.sh into the checkout:
#   autotune_cache.tar -> autotune_cache/<device>/<kernel>.json, merged key by key into the
#                         committed files (the new measurement wins), written canonically;
#   results.json       -> bench/results/<device>.json, plotted to bench/results/<device>.png;
#   attention.json     -> bench/results/<device>_attention.json (bench/attention_bench.py).
# Then `python -m dynctx autotune check` must pass before anything is committed.
#
#   bash bench/device_collect.sh /work/.device/<files_at folder of the run>
set -euo pipefail

SRC=${1:?usage: bench/device_collect.sh FOLDER_WITH_THE_RUN_FILES}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=python3
cd "$REPO"

if [ -f "$SRC/autotune_cache.tar" ]; then
    TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    tar -C "$TMP" -xf "$SRC/autotune_cache.tar"
    "$PY" - "$TMP/autotune_cache" <<'PYEOF'
import json, sys
from pathlib import Path

from dynctx.kernels import _autotune

for new_path in sorted(Path(sys.argv[1]).glob("*/*.json")):
    new = json.loads(new_path.read_text())
    _autotune.validate_cache_data(new, str(new_path))
    target = _autotune.PACKAGED_DIR / new_path.parent.name / new_path.name
    entries = {}
    if target.is_file():
        for entry in json.loads(target.read_text())["entries"]:
            entries[json.dumps(entry["key"], sort_keys=True)] = entry
    kept = len(entries)
    for entry in new["entries"]:
        entries[json.dumps(entry["key"], sort_keys=True)] = entry
    _autotune.write_cache_file(target, device=new["device"], kernel=new["kernel"],
                               entries=list(entries.values()), versions=new["versions"])
    print(f"{target.relative_to(_autotune.PACKAGED_DIR.parent)}: {len(new['entries'])} tuned, "
          f"{len(entries)} in all ({kept} before)")
PYEOF
else
    echo "no autotune_cache.tar in $SRC: nothing tuned to collect"
fi

if [ -f "$SRC/results.json" ]; then
    DEVICE=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['device'])" "$SRC/results.json")
    mkdir -p bench/results
    cp "$SRC/results.json" "bench/results/$DEVICE.json"
    echo "bench/results/$DEVICE.json"
    "$PY" bench/plot_results.py "bench/results/$DEVICE.json" || echo "plot failed (matplotlib?)"
else
    echo "no results.json in $SRC: no bench results to collect"
fi

if [ -f "$SRC/attention.json" ]; then
    DEVICE=$("$PY" -c "import json, sys, re; d = json.load(open(sys.argv[1]))['versions'].get('gpu', 'cpu'); print(re.sub(r'[^A-Za-z0-9_.-]+', '_', d).strip('_'))" "$SRC/attention.json")
    mkdir -p bench/results
    cp "$SRC/attention.json" "bench/results/${DEVICE}_attention.json"
    echo "bench/results/${DEVICE}_attention.json"
else
    echo "no attention.json in $SRC: no paged attention bench to collect"
fi

"$PY" -m dynctx autotune check
