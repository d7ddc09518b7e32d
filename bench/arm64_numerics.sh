#!/usr/bin/env bash
# The emulated DLA core's integers on an ARM64 CPU, without ARM hardware.
#
# Builds a Debian 12 (bookworm) arm64 root filesystem, runs it on this x86-64 host through
# qemu-user (binfmt_misc + chroot), installs the daemon's numeric stack there from PyPI's
# aarch64 wheels, and runs `bench/int8_digest.py` from this checkout (bind-mounted read-only)
# once per emulated CPU model:
#
#   cortex-a76  ARMv8.2 with dot product (sdot/udot), no i8mm: the class of a Jetson Orin's
#               Cortex-A78AE (qemu has no A78; the A76 has the same integer ISA features)
#   cortex-a57  ARMv8.0, plain NEON: no dot product, no i8mm
#   max         everything qemu emulates: dot product, i8mm (smmla/ummla), SVE/SVE2
#
# qemu-user honours QEMU_CPU and reports that CPU's features to the program in AT_HWCAP and
# AT_HWCAP2, which is what onnxruntime (MLAS, through pytorch/cpuinfo or getauxval) picks its
# integer kernels by. qemu-user 7.2 (Debian 12) shows the host's x86 /proc/cpuinfo, though, so
# for each run this script bind-mounts, over the chroot's /proc/cpuinfo, a file in Linux/arm64's
# format: "Features" decoded from that CPU's HWCAP bits and the CPU implementer/part/... fields
# from its MIDR_EL1, as Linux would print them. Without it onnxruntime's cpuinfo library crashes
# (SIGSEGV on import, with the host's /sys), and dlad's cpu summary would name the host's AVX
# flags. The /sys it sees (CPU count, cache topology) is the host's.
#
# Results so far (onnxruntime 1.32.0): every integer tensor matches x86 bit for bit; the fp16
# heads differ in a few values by 1 ulp, from the float32 1x1 head convolution (K=256), so the
# ARM heads_sha256 differs from x86's (found by dumping, on both hosts, the uint8 activations
# and float32 inputs of the three head convolutions: equal; their float32 outputs: K=64 and
# K=128 equal, K=256 not).
#
# Usage (as root; nothing is written to the repository):
#
#   sudo bench/arm64_numerics.sh
#   ARM64_ROOT=/srv/arm64 ARM64_CPUS="cortex-a76 max" sudo -E bench/arm64_numerics.sh
#
# Environment:
#   ARM64_ROOT        root filesystem directory (default /work/arm64-root; must lie outside the
#                     repository)
#   ARM64_CPUS        space-separated qemu CPU models (default "cortex-a76 cortex-a57 max")
#   DEBIAN_MIRROR     Debian mirror for debootstrap (default http://deb.debian.org/debian)
#   DIGEST_TIMEOUT    seconds allowed for one int8_digest run (default 3600)
#   REFERENCE_SHA256  the x86 heads digest to compare with (default: the x86 reference below)
#   ORT_VERSION       onnxruntime version to install (default: the repository .venv's)
#
# Idempotent: every step checks whether it is already done (packages installed, binfmt handler
# registered, root filesystem complete, venv holding the pinned requirements) and skips it.
# Each run's JSON is printed and also kept in $ARM64_ROOT/root/arm64-numerics/<cpu>.json.
set -euo pipefail

# ----------------------------------------------------------------------------- settings
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
ARM64_ROOT="${ARM64_ROOT:-/work/arm64-root}"
ARM64_CPUS="${ARM64_CPUS:-cortex-a76 cortex-a57 max}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DIGEST_TIMEOUT="${DIGEST_TIMEOUT:-3600}"
# heads_sha256.auto of bench/int8_digest.py on x86-64 (AVX-512 VNNI host and AVX2 emulation)
REFERENCE_SHA256="${REFERENCE_SHA256:-7ab518a52eb6ee2118aa1fa1e35996bf687f45b9e9a2abb17c46dbbfc40c0abb}"
SUITE=bookworm
VENV_IN=/opt/dlad-venv            # the venv, as a path inside the chroot
REPO_IN=/mnt/dlad                 # where the checkout appears inside the chroot
CA_IN=/usr/local/share/dlad-host-ca-bundle.crt  # host CA bundle (pip behind a TLS proxy)
RESULTS_IN=/root/arm64-numerics   # per-CPU JSON results, inside the chroot
CHROOT_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# Fallback pins when the repository has no .venv to read versions from.
declare -A DEFAULT_PINS=(
  [numpy]=2.4.6 [onnxruntime]=1.32.0 [onnx]=1.23.2 [pillow]=13.0.0
  [msgpack]=1.2.4 [structlog]=26.1.0
)
PACKAGES=(numpy onnxruntime onnx pillow msgpack structlog)

# ----------------------------------------------------------------------------- helpers
log() { printf '[arm64_numerics %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

STEP_TIMES=()
# timed LABEL CMD...: run CMD, log its wall time, and remember it for the closing summary.
timed() {
  local label="$1"; shift
  local t0 t1 secs
  t0="$(date +%s.%N)"
  log "==> ${label}"
  "$@"
  t1="$(date +%s.%N)"
  secs="$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')"
  log "<== ${label}: ${secs} s"
  STEP_TIMES+=("$(printf '%8s s  %s' "$secs" "$label")")
}

# in_chroot_timeout SECS CPU CMD...: run CMD inside the arm64 root under the qemu CPU model
# CPU, with a clean environment (nothing of the host's pip configuration leaks in), killed
# after SECS seconds (0: no limit).
in_chroot_timeout() {
  local secs="$1" cpu="$2"; shift 2
  local prefix=()
  if [[ "$secs" -gt 0 ]]; then prefix=(timeout "$secs"); fi
  "${prefix[@]}" env -i PATH="$CHROOT_PATH" HOME=/root LANG=C.UTF-8 TERM=dumb \
    PYTHONDONTWRITEBYTECODE=1 PIP_CERT="$CA_IN" PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_DEFAULT_TIMEOUT=180 QEMU_CPU="$cpu" \
    chroot "$ARM64_ROOT" "$@"
}
in_chroot() { in_chroot_timeout 0 "$@"; }

# Mounts this run made, unmounted in reverse order on exit (however the script ends).
MOUNTS=()
mount_tracked() {  # mount_tracked TARGET MOUNT-ARGS...
  local target="$1"; shift
  if mountpoint -q "$target"; then   # left over from an interrupted run
    umount "$target" || umount -l "$target"
  fi
  mount "$@" "$target"
  MOUNTS+=("$target")
}
unmount_one() {
  umount "$1" 2>/dev/null || umount -l "$1" || log "could not unmount $1"
}
cleanup() {
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
    unmount_one "${MOUNTS[i]}"
  done
  MOUNTS=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ----------------------------------------------------------------------------- checks
[[ "$(id -u)" -eq 0 ]] || die "run as root (debootstrap, chroot and mount need it)"
[[ "$(uname -m)" == x86_64 ]] || log "note: host is $(uname -m), not x86_64"
ARM64_ROOT="$(realpath -m "$ARM64_ROOT")"
case "$ARM64_ROOT/" in
  / | "$REPO"/* ) die "ARM64_ROOT=$ARM64_ROOT must lie outside the repository ($REPO) and not be /" ;;
esac
case "$REPO/" in
  "$ARM64_ROOT"/* ) die "ARM64_ROOT=$ARM64_ROOT must not contain the repository" ;;
esac
read -r -a CPUS <<< "$ARM64_CPUS"
[[ "${#CPUS[@]}" -gt 0 ]] || die "ARM64_CPUS is empty"

# ----------------------------------------------------------------------------- 1. host packages
install_host_packages() {
  local missing=() pkg
  for pkg in qemu-user-static debootstrap binfmt-support; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' \
      || missing+=("$pkg")
  done
  if [[ "${#missing[@]}" -eq 0 ]]; then
    log "already installed: qemu-user-static debootstrap binfmt-support"
    return
  fi
  log "installing: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# The kernel must hand aarch64 ELF files to qemu: binfmt_misc mounted, qemu-aarch64 enabled.
# Debian's entry has the F flag (the interpreter is opened at registration), so the chroot
# needs no copy of qemu; one is copied in anyway (step 2) for hosts whose entry lacks F.
ensure_binfmt() {
  local entry=/proc/sys/fs/binfmt_misc/qemu-aarch64
  if [[ ! -e /proc/sys/fs/binfmt_misc/register ]]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  fi
  if [[ ! -e "$entry" ]] || ! grep -qx enabled "$entry"; then
    update-binfmts --enable qemu-aarch64
  fi
  grep -qx enabled "$entry" || die "binfmt_misc handler qemu-aarch64 is not enabled"
  log "binfmt: $(tr '\n' ' ' < "$entry")"
}

# ----------------------------------------------------------------------------- 2. root filesystem
rootfs_complete() {
  [[ -x "$ARM64_ROOT/usr/bin/python3.11" && ! -e "$ARM64_ROOT/debootstrap" ]]
}

make_rootfs() {
  if rootfs_complete; then
    log "root filesystem already complete: $ARM64_ROOT"
    return
  fi
  if [[ ! -x "$ARM64_ROOT/debootstrap/debootstrap" ]]; then
    # No first stage yet: the directory must be new or empty.
    if [[ -d "$ARM64_ROOT" ]] && [[ -n "$(ls -A "$ARM64_ROOT")" ]]; then
      die "$ARM64_ROOT exists, is not empty and holds no complete or resumable debootstrap; remove it"
    fi
    mkdir -p "$ARM64_ROOT"
    log "debootstrap first stage (arm64, $SUITE, $DEBIAN_MIRROR)"
    debootstrap --arch=arm64 --foreign --variant=minbase \
      --include=python3,python3-venv,ca-certificates \
      "$SUITE" "$ARM64_ROOT" "$DEBIAN_MIRROR"
  fi
  install -m 0755 /usr/bin/qemu-aarch64-static "$ARM64_ROOT/usr/bin/qemu-aarch64-static"
  log "debootstrap second stage (inside the chroot, under qemu-aarch64)"
  in_chroot max /debootstrap/debootstrap --second-stage
  rootfs_complete || die "second stage finished but $ARM64_ROOT is incomplete"
}

# ----------------------------------------------------------------------------- 3. mounts
mount_chroot() {
  # Files the chroot's pip needs from the host: name resolution and the CA bundle (the host
  # may reach PyPI through a TLS-inspecting proxy whose CA only the host bundle holds).
  cp -L /etc/resolv.conf "$ARM64_ROOT/etc/resolv.conf"
  install -m 0644 /etc/ssl/certs/ca-certificates.crt "$ARM64_ROOT$CA_IN"
  mkdir -p "$ARM64_ROOT$REPO_IN" "$ARM64_ROOT$RESULTS_IN"
  mount_tracked "$ARM64_ROOT/proc" -t proc proc
  mount_tracked "$ARM64_ROOT/sys" -t sysfs -o ro sysfs
  mount_tracked "$ARM64_ROOT/dev" --bind /dev
  mount_tracked "$ARM64_ROOT$REPO_IN" --bind "$REPO"
  mount -o remount,bind,ro "$ARM64_ROOT$REPO_IN"
  if touch "$ARM64_ROOT$REPO_IN/.arm64-write-test" 2>/dev/null; then
    rm -f "$ARM64_ROOT$REPO_IN/.arm64-write-test"
    die "the repository bind mount is writable"
  fi
  log "repository $REPO -> $ARM64_ROOT$REPO_IN (read-only)"
}

# ----------------------------------------------------------------------------- 4. the venv
# name==version for each package: the repository .venv's versions, so both hosts run the same.
requirements() {
  local pkg ver host_py="$REPO/.venv/bin/python"
  for pkg in "${PACKAGES[@]}"; do
    ver=""
    if [[ "$pkg" == onnxruntime && -n "${ORT_VERSION:-}" ]]; then
      ver="$ORT_VERSION"
    elif [[ -x "$host_py" ]]; then
      ver="$("$host_py" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$pkg")"
    fi
    printf '%s==%s\n' "$pkg" "${ver:-${DEFAULT_PINS[$pkg]}}"
  done
}

make_venv() {
  local want stamp="$ARM64_ROOT$VENV_IN/.dlad-requirements"
  want="$(requirements)"
  # (Checked through package metadata: importing onnxruntime here, with the host's x86
  # /proc/cpuinfo visible, would crash it; see run_digest.)
  # shellcheck disable=SC2086  # $want: one argument per requirement line
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
    && in_chroot max "$VENV_IN/bin/python" -c 'import importlib.metadata as m, sys
for line in sys.argv[1:]:
    name, ver = line.split("==")
    assert m.version(name) == ver, line' $want; then
    log "venv already holds: $(tr '\n' ' ' <<< "$want")"
    return
  fi
  if [[ ! -x "$ARM64_ROOT$VENV_IN/bin/python" ]]; then
    in_chroot max /usr/bin/python3 -m venv "$VENV_IN"
  fi
  printf '%s\n' "$want" > "$ARM64_ROOT$VENV_IN/requirements.txt"
  log "pip install (aarch64 wheels only; no source builds): $(tr '\n' ' ' <<< "$want")"
  if ! in_chroot max "$VENV_IN/bin/pip" install --only-binary=:all: \
    -r "$VENV_IN/requirements.txt"; then
    log "pip failed; onnxruntime versions with a wheel for this platform:"
    in_chroot max "$VENV_IN/bin/pip" index versions --only-binary=:all: onnxruntime || true
    die "could not install the pinned requirements (set ORT_VERSION to the nearest one)"
  fi
  printf '%s\n' "$want" > "$stamp"
}

# ----------------------------------------------------------------------------- 5. the digests
# Run inside the chroot under one CPU model: the machine, AT_HWCAP/AT_HWCAP2 decoded with
# Linux's arm64 names, MIDR_EL1 (read with `mrs`, which qemu-user answers for the emulated CPU
# as Linux does through its HWCAP_CPUID emulation), and with --cpuinfo N a /proc/cpuinfo for N
# processors in Linux/arm64's format (processor, BogoMIPS, Features, CPU implementer, ...).
read -r -d '' HWCAP_PY <<'EOF' || true
import ctypes, mmap, platform, struct, sys
HWCAP = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt "
         "fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs "
         "sb paca pacg").split()
HWCAP2 = ("dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svef32mm "
          "svef64mm svebf16 i8mm bf16 dgh rng bti mte ecv afp rpres mte3 sme sme_i16i64 "
          "sme_f64f64 sme_i8i32 sme_f16f32 sme_b16f32 sme_f32f32 sme_fa64 wfxt").split()
getauxval = ctypes.CDLL(None).getauxval
getauxval.restype = ctypes.c_ulong
getauxval.argtypes = [ctypes.c_ulong]
hw, hw2 = getauxval(16), getauxval(26)  # AT_HWCAP, AT_HWCAP2
names = [n for i, n in enumerate(HWCAP) if hw >> i & 1]
names += [n for i, n in enumerate(HWCAP2) if hw2 >> i & 1]
# MIDR_EL1: two instructions in an executable page (mrs x0, midr_el1; ret).
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(struct.pack("<II", 0xD5380000, 0xD65F03C0))
midr = ctypes.CFUNCTYPE(ctypes.c_uint64)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
if sys.argv[1:2] == ["--cpuinfo"]:
    for cpu in range(int(sys.argv[2])):
        print(f"processor\t: {cpu}\nBogoMIPS\t: 50.00\nFeatures\t: {' '.join(names)}\n"
              f"CPU implementer\t: 0x{midr >> 24 & 0xff:02x}\nCPU architecture: 8\n"
              f"CPU variant\t: 0x{midr >> 20 & 0xf:x}\nCPU part\t: 0x{midr >> 4 & 0xfff:03x}\n"
              f"CPU revision\t: {midr & 0xf}\n")
else:
    print(f"platform.machine(): {platform.machine()}")
    print(f"MIDR_EL1=0x{midr:08x} AT_HWCAP=0x{hw:x} AT_HWCAP2=0x{hw2:x}")
    print(f"HWCAP features: {' '.join(names)}")
    key = {"asimddp": "dot product", "i8mm": "i8mm", "sve": "SVE"}
    print("MLAS-relevant: " + ", ".join(f"{v}={'yes' if k in names else 'no'}" for k, v in key.items()))
EOF

FAILED=()
run_digest() {
  local cpu="$1" fake="$ARM64_ROOT$RESULTS_IN/cpuinfo.$1" out="$ARM64_ROOT$RESULTS_IN/$1.json"
  echo
  echo "================================================================ QEMU_CPU=${cpu}"
  if ! in_chroot "$cpu" /usr/bin/python3 -c "$HWCAP_PY"; then
    FAILED+=("$cpu (qemu does not run this CPU model)")
    return 0
  fi
  echo "host /proc/cpuinfo as qemu-user 7.2 shows it inside (not the emulated CPU's):"
  in_chroot "$cpu" /bin/sh -c 'grep -m1 -E "^(flags|Features)" /proc/cpuinfo | cut -c1-100' || true
  # Linux/arm64's /proc/cpuinfo for this CPU, bind-mounted over the chroot's for this run only.
  # Needed, not cosmetic: onnxruntime's pytorch/cpuinfo, given the host's x86 /proc/cpuinfo
  # (no MIDR) together with /sys, dies with SIGSEGV while importing onnxruntime; with the MIDR
  # lines it initializes as on real hardware (and takes its ISA features from AT_HWCAP).
  in_chroot "$cpu" /usr/bin/python3 -c "$HWCAP_PY" --cpuinfo "$(nproc)" > "$fake"
  mount_tracked "$ARM64_ROOT/proc/cpuinfo" --bind "$fake"
  echo "/proc/cpuinfo inside for this run (from HWCAP): $(grep -m1 Features "$ARM64_ROOT/proc/cpuinfo")"
  echo "--- python bench/int8_digest.py (QEMU_CPU=${cpu}) ---"
  if in_chroot_timeout "$DIGEST_TIMEOUT" "$cpu" "$VENV_IN/bin/python" \
      "$REPO_IN/bench/int8_digest.py" > "$out"; then
    cat "$out"
  else
    FAILED+=("$cpu (int8_digest exit status $?)")
    cat "$out"
  fi
  unmount_one "$ARM64_ROOT/proc/cpuinfo"
  unset 'MOUNTS[${#MOUNTS[@]}-1]'
}

summarize() {
  local cpu
  echo
  echo "================================================================ summary"
  echo "x86 reference heads_sha256: $REFERENCE_SHA256"
  local files=()
  for cpu in "${CPUS[@]}"; do files+=("$ARM64_ROOT$RESULTS_IN/$cpu.json"); done
  python3 - "${files[@]}" <<'EOF' || true
import json, sys
digests = set()
for path in sys.argv[1:]:
    try:
        digests.update(json.load(open(path))["heads_sha256"].values())
    except (OSError, ValueError, KeyError):
        pass
print(f"distinct heads_sha256 over all ARM runs and operands: {len(digests)} {sorted(digests)}")
EOF
  for cpu in "${CPUS[@]}"; do
    python3 - "$ARM64_ROOT$RESULTS_IN/$cpu.json" "$cpu" "$REFERENCE_SHA256" <<'EOF' || echo "$cpu: no result"
import json, sys
path, cpu, ref = sys.argv[1:4]
r = json.load(open(path))
eq = " ".join(f"{c}={'EQUAL' if d == ref else 'DIFFERENT'}" for c, d in r["heads_sha256"].items())
bad = {c: {k: v for k, v in m.items() if v} for c, m in r["large_sum_mismatches"].items()}
bad = {c: m for c, m in bad.items() if m}
print(f"{cpu:11s} operands={r['kernel_path']['operands']}  {eq}  "
      f"large_sum_mismatches={'none' if not bad else bad}")
EOF
  done
}

# ----------------------------------------------------------------------------- main
timed "1. host packages (apt)" install_host_packages
timed "1b. binfmt_misc qemu-aarch64" ensure_binfmt
timed "2. arm64 root filesystem ($ARM64_ROOT)" make_rootfs
timed "3. mounts" mount_chroot
log "chroot python: $(in_chroot max /usr/bin/python3 -c 'import platform, sys; print(sys.version.split()[0], platform.machine())')"
timed "4. venv + pip (aarch64 wheels)" make_venv
for cpu in "${CPUS[@]}"; do
  timed "5. int8_digest QEMU_CPU=$cpu" run_digest "$cpu"
done
summarize
echo
echo "step wall times:"
printf '%s\n' "${STEP_TIMES[@]}"
if [[ "${#FAILED[@]}" -gt 0 ]]; then
  die "failed: ${FAILED[*]}"
fi
