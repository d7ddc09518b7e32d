# Sourced by the bench/h200_*.sh scripts on the H200 machine: installs the carried wheels (.whl/,
# or $WHEELS; made here by bench/fetch_h200_wheels.sh) into /tmp/site and sets the environment dlad, prep
# and the clients run in there; $out is where results go (the device tool's $OUT).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${WHEELS:-.whl}"/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD:$PWD/clients" PYTHONUNBUFFERED=1 DLAD_CACHE_DIR=/tmp/dlad-cache
out="${OUT:-/tmp/out}"; mkdir -p "$out"
# The C++ cores, built in place as pip would: the native data plane and its scheduler
# (dlad/native/), and the wire's rules (clients/dlad_wire/native/); dlad does not serve without them.
{ python3 setup.py -q build_ext --inplace -j "$(nproc)" \
    && (cd clients && python3 setup.py -q build_ext --inplace); } >"$out/native-build.log" 2>&1 \
    || { echo "h200_env: the C++ core did not build (see native-build.log)"; tail -20 "$out/native-build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
