# Sourced by the bench/h200_*.sh scripts on the H200 machine: installs the carried wheels (.whl/,
# made here by bench/fetch_h200_wheels.sh) into /tmp/site and sets the environment dlad, prep
# and the clients run in there; $out is where results go (the device tool's $OUT).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD:$PWD/clients" PYTHONUNBUFFERED=1 DLAD_CACHE_DIR=/tmp/dlad-cache
out="${OUT:-/tmp/out}"; mkdir -p "$out"
# The scheduler's C++ core, built in place as pip would (dlad/native/); without Python's headers
# the daemon runs the Python scheduler ([scheduler] core = "auto"), and says so here.
if [[ -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]]; then
    python3 setup.py -q build_ext --inplace >"$out/native-build.log" 2>&1 \
        || { echo "h200_env: the C++ scheduler core did not build (see native-build.log)"; }
else
    echo "h200_env: no Python.h here: the daemon runs the Python scheduler"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
