#!/usr/bin/env bash
# Bring the results of bench/device_check.sh into the checkout (<device>: the GPU's name as
# autotune_cache/ spells it, NVIDIA_H200):
#   autotune_cache.tar  -> autotune_cache/<device>/<kernel>.json, merged key by key into the
#                          committed files (the new measurement wins), written canonically;
#   engine_graphs.json  -> bench/results/<device>_engine_graphs.json (bench/gpu_engine_graphs.py);
#   attention.json      -> bench/results/<device>_attention.json (bench/attention_bench.py);
#   smoke.jsonl         -> bench/results/<device>_smoke.jsonl (bench/device_smoke.py).
# Files of a run without a GPU (a dry run) are refused. Then `python -m dynctx autotune check`
# must pass before anything is committed.
#
#   bash bench/device_collect.sh /work/.device/<files_at folder of the run>
set -euo pipefail

SRC=${1:?usage: bench/device_collect.sh FOLDER_WITH_THE_RUN_FILES}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=python3
cd "$REPO"

# The GPU the files come from: the first of them that names one.
DEVICE=$("$PY" -P - "$SRC" <<'PYEOF'
import json, re, sys
from pathlib import Path

src = Path(sys.argv[1])
names = []
for name, read in (("engine_graphs.json", lambda d: d.get("gpu")),
                   ("attention.json", lambda d: d.get("versions", {}).get("gpu"))):
    try:
        names.append(read(json.loads((src / name).read_text())))
    except (OSError, ValueError):
        pass
try:
    lines = (src / "smoke.jsonl").read_text().splitlines()
    names += [json.loads(line).get("gpu") for line in lines if line.strip()]
except (OSError, ValueError):
    pass
gpu = next((n for n in names if n), None)
print(re.sub(r"[^A-Za-z0-9_.-]+", "_", gpu).strip("_") if gpu else "")
PYEOF
)
if [ -z "$DEVICE" ]; then
    echo "device_collect: no file in $SRC names a GPU (a dry run on a CPU?): nothing collected" >&2
    exit 1
fi
echo "device: $DEVICE"

if [ -f "$SRC/autotune_cache.tar" ]; then
    TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    tar -C "$TMP" -xf "$SRC/autotune_cache.tar"
    "$PY" -P - "$TMP/autotune_cache" <<'PYEOF'
import json, sys
from pathlib import Path

from dynctx.kernels import autotune

for new_path in sorted(Path(sys.argv[1]).glob("*/*.json")):
    new = json.loads(new_path.read_text())
    autotune.validate_cache_data(new, str(new_path))
    target = autotune.PACKAGED_DIR / new_path.parent.name / new_path.name
    entries = {}
    if target.is_file():
        for entry in json.loads(target.read_text())["entries"]:
            entries[json.dumps(entry["key"], sort_keys=True)] = entry
    kept = len(entries)
    for entry in new["entries"]:
        entries[json.dumps(entry["key"], sort_keys=True)] = entry
    autotune.write_cache_file(target, device=new["device"], kernel=new["kernel"],
                               entries=list(entries.values()), versions=new["versions"])
    print(f"{target.relative_to(autotune.PACKAGED_DIR.parent)}: {len(new['entries'])} in the "
          f"run, {len(entries)} in all ({kept} before)")
PYEOF
else
    echo "no autotune_cache.tar in $SRC: nothing tuned to collect"
fi

mkdir -p bench/results
for pair in engine_graphs.json:engine_graphs.json attention.json:attention.json \
            smoke.jsonl:smoke.jsonl; do
    name=${pair%%:*}
    if [ -f "$SRC/$name" ]; then
        cp "$SRC/$name" "bench/results/${DEVICE}_${pair#*:}"
        echo "bench/results/${DEVICE}_${pair#*:}"
    else
        echo "no $name in $SRC"
    fi
done

"$PY" -P -m dynctx autotune check
