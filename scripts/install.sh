#!/usr/bin/env bash
# Install edged as a systemd service (docs/systemd.md explains every step).
#
#   sudo scripts/install.sh                    # install or upgrade from this checkout, start it
#   sudo scripts/install.sh --wheel edged.whl  # from a wheel instead of the checkout
#   sudo scripts/install.sh --no-start         # install and enable, start at next boot
#   sudo scripts/install.sh --uninstall        # remove the service, keep config, engines, user
#   sudo scripts/install.sh --uninstall --purge  # ... and remove config, state and engines too
#   scripts/install.sh --plan [--python PATH]  # what it would do about TensorRT here; changes nothing
#
# Idempotent: running it again upgrades the package, keeps /etc/edged/edged.toml as the
# operator left it, and restarts the service if it was running.
#
# On a Jetson it makes TensorRT and pycuda import under the environment's Python, or stops and
# says why (--cpu-only installs for ONNX Runtime instead): JetPack 6 and 7 ship TensorRT's Python
# bindings for their own Python (3.10, 3.12), JetPack 5's are for Python 3.8, which edged cannot
# run on, so there it builds them for the environment's Python from NVIDIA's open-source TensorRT
# at the commit of the installed libnvinfer (docs/tensorrt.md#what-it-needs).
set -euo pipefail

PREFIX=/opt/edged
VENV="$PREFIX/venv"
CONF_DIR=/etc/edged
UNIT_DIR=/etc/systemd/system
SYSUSERS_DIR=/etc/sysusers.d
TMPFILES_DIR=/etc/tmpfiles.d
APT_CONF_DIR=/etc/apt/apt.conf.d
APT_HOOK="$PREFIX/libexec/edged-apt-hook"
UNITS=(edged.socket edged.service)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The distribution's interpreter by default: a venv refers to its base interpreter, and one under
# /root or /home (pyenv, conda) is hidden from the service by ProtectHome=yes.
if [ -z "${PYTHON:-}" ]; then
    if [ -x /usr/bin/python3 ]; then PYTHON=/usr/bin/python3; else PYTHON=python3; fi
fi
WHEEL=""
ACTION=install
START=1
PURGE=0
APT=1
CPU_ONLY=0

# Where the JetPack files are read from: "" on a device; the unit tests point it at fixtures.
ROOT=${EDGED_INSTALL_ROOT:-}
ARCH=${EDGED_ARCH:-$(uname -m)}
CUDA_ROOT=${CUDA_ROOT:-/usr/local/cuda}
# TensorRT's Python bindings are built from NVIDIA/TensorRT at the commit of the libnvinfer
# JetPack installed (release/8.5 has no tags; these are its release commits), against pybind11
# 2.13.6, the newest 2.x (C++11, as the 8.5 sources build; Python 3.7 to 3.13).
declare -A TRT_COMMITS=(
    [8.5.1]=1d6bf36034bb07fc88d924ebf5d34d358298e545
    [8.5.2]=ad932f72126f875392a4336d9ee45b2756d934a0
    [8.5.3]=b0c259a749aab1486ed3b4458e7176555b003497
)
PYBIND11_TAG=v2.13.6
TRT_SOURCE_URL=${EDGED_TRT_SOURCE_URL:-https://github.com/NVIDIA/TensorRT/archive}
PYBIND11_URL=${EDGED_PYBIND11_URL:-https://github.com/pybind/pybind11/archive/refs/tags}
WHEEL_DIR="$PREFIX/wheels"

say() { printf 'install.sh: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

usage() {
    sed -n '2,18s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
    cat <<EOF
Options:
  --wheel PATH      install this wheel instead of the checkout at $REPO
  --python PATH     interpreter for the virtual environment (default: /usr/bin/python3; 3.10+)
  --unit-dir DIR    where the units go (default: $UNIT_DIR; /usr/local/lib/systemd/system works)
  --no-start        enable the units but do not start them now
  --no-apt          never apt-get anything (systemd-python's build dependencies, TensorRT's)
  --cpu-only        on a Jetson: install without TensorRT and pycuda; ONNX Runtime serves
  --plan            print what would be done about TensorRT and pycuda here, change nothing
  --uninstall       stop and remove the service and $PREFIX
  --purge           with --uninstall: also remove $CONF_DIR, /var/lib/edged, /var/cache/edged
EOF
}

parse_args() {
    while [ $# -gt 0 ]; do
        case "$1" in
            --wheel) WHEEL=${2:?--wheel needs a path}; shift ;;
            --python) PYTHON=${2:?--python needs a path}; shift ;;
            --unit-dir) UNIT_DIR=${2:?--unit-dir needs a directory}; shift ;;
            --no-start) START=0 ;;
            --no-apt) APT=0 ;;
            --cpu-only) CPU_ONLY=1 ;;
            --plan) ACTION=plan ;;
            --uninstall) ACTION=uninstall ;;
            --purge) PURGE=1 ;;
            -h|--help) usage; exit 0 ;;
            *) usage >&2; die "unknown option: $1" ;;
        esac
        shift
    done
    if [ "$PURGE" = 1 ] && [ "$ACTION" != uninstall ]; then
        die "--purge only goes with --uninstall"
    fi
}

# systemctl only where systemd runs: an image built in a chroot gets files, not a started unit.
systemd_running() { [ -d /run/systemd/system ]; }

is_jetson() { [ -e "$ROOT/etc/nv_tegra_release" ]; }

check_python() {
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found (use --python)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "$PYTHON is $("$PYTHON" -V 2>&1); edged needs Python 3.10+ ($(python_hint))"
    "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null \
        || die "$PYTHON cannot create virtual environments (apt-get install python3-venv)"
    local real
    real=$("$PYTHON" -c 'import os, sys; print(os.path.realpath(sys.executable))')
    case "$real" in
        /root/*|/home/*|/run/user/*)
            die "$PYTHON is $real, which edged.service cannot run (ProtectHome=yes hides it); use --python /usr/bin/python3.X" ;;
    esac
}

# --- JetPack: TensorRT and pycuda under the environment's Python --------------------------------

# "35.4.1" from "# R35 (release), REVISION: 4.1, ..."; "" off a Jetson.
l4t_release() {
    [ -r "$ROOT/etc/nv_tegra_release" ] || return 0
    sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\1.\2/p' "$ROOT/etc/nv_tegra_release" | head -n 1
}

# L4T's major release names the JetPack: R32 is JetPack 4, R35 (R34 in its previews) 5, R36 6, R38 7.
jetpack_major() {
    case "${1%%.*}" in
        32) echo 4 ;; 34|35) echo 5 ;; 36) echo 6 ;; 38) echo 7 ;; *) echo "" ;;
    esac
}

# The version of an installed Debian package, from dpkg's status file ("" when not installed).
deb_version() {
    [ -r "$ROOT/var/lib/dpkg/status" ] || return 0
    awk -v pkg="$1" 'BEGIN { RS = ""; FS = "\n" }
        {
            name = ""; version = ""; ok = 0
            for (i = 1; i <= NF; i++) {
                if ($i ~ /^Package: /) name = substr($i, 10)
                else if ($i ~ /^Status: .* installed$/) ok = 1
                else if ($i ~ /^Version: /) version = substr($i, 10)
            }
            if (name == pkg && ok) { print version; exit }
        }' "$ROOT/var/lib/dpkg/status"
}

# The installed TensorRT as MAJOR.MINOR.PATCH[.BUILD]: its header (libnvinfer-dev) names the
# build; else the runtime's package (JetPack 5: "8.5.2-1+cuda11.4", 6.1: "10.3.0.30-1+cuda12.5").
tensorrt_version() {
    local header="$ROOT/usr/include/$ARCH-linux-gnu/NvInferVersion.h" parts="" key v pkg
    if [ -r "$header" ]; then
        for key in MAJOR MINOR PATCH BUILD; do
            v=$(sed -n "s/^#define \(NV_TENSORRT_$key\|TRT_${key}_ENTERPRISE\) *\([0-9][0-9]*\).*/\2/p" "$header" | head -n 1)
            [ -n "$v" ] || break
            parts="${parts:+$parts.}$v"
        done
        if [ -n "$parts" ]; then
            echo "$parts"
            return 0
        fi
    fi
    for pkg in tensorrt libnvinfer10 libnvinfer8; do
        v=$(deb_version "$pkg")
        if [ -n "$v" ]; then
            echo "${v%%-*}"
            return 0
        fi
    done
    echo ""
}

# The Python JetPack's own bindings are for, from the files python3-libnvinfer installed
# (/usr/lib/python3.8/dist-packages/tensorrt/...); else what each JetPack ships.
bindings_python() {
    local list
    for list in "$ROOT"/var/lib/dpkg/info/python3-libnvinfer.list "$ROOT"/var/lib/dpkg/info/python3-libnvinfer:*.list; do
        [ -r "$list" ] || continue
        sed -n 's|^/usr/lib/python\(3\.[0-9]*\)/dist-packages/tensorrt/.*|\1|p' "$list" | head -n 1
        return 0
    done
    case "$1" in 5) echo 3.8 ;; 6) echo 3.10 ;; 7) echo 3.12 ;; *) echo "" ;; esac
}

python_version() { "$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo ""; }

# What check_python says to a Python that is too old.
python_hint() {
    if [ "$(jetpack_major "$(l4t_release)")" = 5 ]; then
        echo "JetPack 5's Python is 3.8: install Python 3.10 (sudo add-apt-repository ppa:deadsnakes/ppa; sudo apt install python3.10 python3.10-venv python3.10-dev) and pass --python /usr/bin/python3.10; this script then builds TensorRT's Python bindings for it"
    else
        echo "pass --python PATH to a Python 3.10 or newer"
    fi
}

# Decide what to do about TensorRT here. Sets TRT_PLAN to one of
#   none    not a Jetson: TensorRT is the operator's (its wheel in the environment), else the CPU
#   system  JetPack's bindings are for this Python: the environment sees the system's packages
#   apt     as system, once python3-libnvinfer is installed
#   build   build the bindings for this Python from NVIDIA/TensorRT at TRT_COMMIT
#   cpu     --cpu-only on a Jetson
#   refuse  none of these can work; TRT_WHY says why and what to do
# and TRT_VERSION, TRT_PYTHON (the Python JetPack's bindings are for), JETPACK, L4T.
plan_tensorrt() {
    local l4t jp py mmp
    l4t=$(l4t_release)
    jp=$(jetpack_major "$l4t")
    py=$(python_version)
    TRT_VERSION=$(tensorrt_version)
    TRT_PYTHON=$(bindings_python "$jp")
    TRT_COMMIT=""
    TRT_WHY=""
    JETPACK=${jp:-none}
    L4T=${l4t:-none}
    if [ -z "$l4t" ]; then
        TRT_PLAN=none
        TRT_WHY="not a Jetson: for an NVIDIA GPU install TensorRT's wheel into $VENV (pip install tensorrt-cu12) and pycuda, else ONNX Runtime serves on the CPU"
        return 0
    fi
    if [ "$CPU_ONLY" = 1 ]; then
        TRT_PLAN=cpu
        TRT_WHY="--cpu-only: ONNX Runtime serves on the CPU (edged status says so)"
        return 0
    fi
    TRT_PLAN=refuse
    if [ -z "$jp" ] || [ "$jp" = 4 ]; then
        TRT_WHY="L4T $l4t (JetPack ${jp:-unknown}) ships TensorRT 8.2 or older and Python 3.6; edged's TensorRT backend needs TensorRT 8.5 (JetPack 5.1) or newer: upgrade JetPack, or install with --cpu-only"
        return 0
    fi
    if [ -z "$TRT_VERSION" ]; then
        TRT_WHY="TensorRT is not installed (no libnvinfer): sudo apt install nvidia-jetpack (or libnvinfer-dev python3-libnvinfer), or install with --cpu-only"
        return 0
    fi
    case "$TRT_VERSION" in
        [0-7].*|8.[0-4].*)
            TRT_WHY="JetPack $jp here has TensorRT $TRT_VERSION; edged needs 8.5 or newer (JetPack 5.1+): upgrade JetPack (L4T 35.2 or later), or install with --cpu-only"
            return 0 ;;
    esac
    if [ -z "$py" ]; then
        TRT_WHY="$PYTHON does not run"
        return 0
    fi
    if [ "$py" = "$TRT_PYTHON" ]; then
        if [ -n "$(deb_version python3-libnvinfer)" ]; then TRT_PLAN=system; else TRT_PLAN=apt; fi
        return 0
    fi
    mmp=$(echo "$TRT_VERSION" | cut -d. -f1-3)
    if [ -n "${TRT_COMMITS[$mmp]:-}" ]; then
        TRT_PLAN=build
        TRT_COMMIT=${TRT_COMMITS[$mmp]}
        return 0
    fi
    TRT_WHY="JetPack $jp's TensorRT $TRT_VERSION has Python bindings for Python $TRT_PYTHON, and $PYTHON is $py: use --python /usr/bin/python$TRT_PYTHON (edged runs on it), or install with --cpu-only"
}

print_plan() {
    plan_tensorrt
    printf '%s\n' \
        "l4t=$L4T" \
        "jetpack=$JETPACK" \
        "python=$(python_version)" \
        "tensorrt=${TRT_VERSION:-none}" \
        "bindings_python=${TRT_PYTHON:-none}" \
        "plan=$TRT_PLAN"
    [ -z "$TRT_COMMIT" ] || printf '%s\n' "source=NVIDIA/TensorRT@$TRT_COMMIT" "pybind11=$PYBIND11_TAG"
    case "$TRT_PLAN" in
        system|apt|build) echo "pycuda=pip, built against $CUDA_ROOT" ;;
        *) echo "pycuda=none" ;;
    esac
    [ -z "$TRT_WHY" ] || echo "why=$TRT_WHY"
}

# Parallel compiles that fit: a pybind11 translation unit takes up to about 1.5 GiB to compile.
build_jobs() {
    local jobs
    jobs=$(awk '/^MemAvailable:/ { print int($2 / 1572864) }' /proc/meminfo 2>/dev/null || echo 1)
    [ "${jobs:-0}" -ge 1 ] || jobs=1
    [ "$jobs" -le "$(nproc)" ] || jobs=$(nproc)
    echo "$jobs"
}

fetch_tarball() {  # URL DIR: unpack a GitHub archive into DIR (its top folder stripped)
    mkdir -p "$2"
    curl -fsSL --retry 3 "$1" | tar -xz -C "$2" --strip-components=1
}

# Build TensorRT's Python bindings (python/ of NVIDIA/TensorRT at TRT_COMMIT) for $PYTHON against
# the installed libnvinfer, as that folder's build.sh does, with the compiler jobs memory allows.
# The wheel is kept in $WHEEL_DIR, so a reinstall does not build it again. Prints its path.
build_tensorrt_bindings() {
    local py pytag include work src wheel lib_dir trt_include
    py=$(python_version)
    pytag="cp${py/./}"
    wheel=$(find "$WHEEL_DIR" -name "tensorrt-$TRT_VERSION*-$pytag-*.whl" 2>/dev/null | head -n 1 || true)
    if [ -n "$wheel" ]; then
        echo "$wheel"
        return 0
    fi
    lib_dir=${EDGED_TRT_LIB_DIR:-/usr/lib/$ARCH-linux-gnu}
    trt_include=${EDGED_TRT_INCLUDE_DIR:-/usr/include/$ARCH-linux-gnu}
    include=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    [ -e "$include/Python.h" ] || die "no Python.h for $PYTHON in $include (apt install python$py-dev)"
    [ -e "$trt_include/NvOnnxParser.h" ] || die "no $trt_include/NvOnnxParser.h (apt install libnvonnxparsers-dev)"
    work=$(mktemp -d /tmp/edged-tensorrt-bindings.XXXXXX)
    src="$work/TensorRT"
    say "building TensorRT $TRT_VERSION's Python bindings for Python $py (NVIDIA/TensorRT@${TRT_COMMIT:0:8}); this takes minutes"
    if [ -n "${EDGED_TRT_SOURCE_DIR:-}" ]; then
        cp -a "$EDGED_TRT_SOURCE_DIR" "$src"
    else
        fetch_tarball "$TRT_SOURCE_URL/$TRT_COMMIT.tar.gz" "$src"
    fi
    mkdir -p "$work/ext"
    if [ -n "${EDGED_PYBIND11_DIR:-}" ]; then
        cp -a "$EDGED_PYBIND11_DIR" "$work/ext/pybind11"
    else
        fetch_tarball "$PYBIND11_URL/$PYBIND11_TAG.tar.gz" "$work/ext/pybind11"
    fi
    # The bindings look for Python under EXT_PATH/pythonX.Y/include and for the ONNX parser's
    # header in the parsers/onnx submodule (not in the archive): JetPack's own headers serve both.
    mkdir -p "$work/ext/python$py" "$src/parsers/onnx"
    ln -sfn "$include" "$work/ext/python$py/include"
    ln -sf "$trt_include/NvOnnxParser.h" "$src/parsers/onnx/NvOnnxParser.h"
    cmake -S "$src/python" -B "$src/python/build" -DCMAKE_BUILD_TYPE=Release -DTARGET="$ARCH" \
        -DPYTHON_MAJOR_VERSION="${py%%.*}" -DPYTHON_MINOR_VERSION="${py#*.}" -DEXT_PATH="$work/ext" \
        -DCUDA_INCLUDE_DIRS="$CUDA_ROOT/include" -DTENSORRT_ROOT="$src" -DTENSORRT_BUILD="$lib_dir" >&2
    make -C "$src/python/build" -j"$(build_jobs)" >&2
    package_tensorrt_bindings "$src" "$pytag" >&2
    mkdir -p "$WHEEL_DIR"
    cp "$src"/python/build/dist/tensorrt-*.whl "$WHEEL_DIR"/
    rm -rf "$work"
    find "$WHEEL_DIR" -name "tensorrt-$TRT_VERSION*-$pytag-*.whl" | head -n 1
}

# The wheel around the built tensorrt.so, as build.sh makes it: packaging/ with the version in.
package_tensorrt_bindings() {
    local src=$1 pytag=$2 version mmp out="$1/python/build" file key
    version=$(for key in MAJOR MINOR PATCH BUILD; do
        sed -n "s/^#define NV_TENSORRT_$key \([0-9]*\).*/\1/p" "$src/include/NvInferVersion.h"
    done | paste -sd.)
    mmp=$(echo "$version" | cut -d. -f1-3)
    (cd "$src/python/packaging" && find . -type f) | while read -r file; do
        mkdir -p "$out/$(dirname "$file")"
        sed -e "s|##TENSORRT_VERSION##|$version|g" -e "s|##TENSORRT_MAJMINPATCH##|$mmp|g" \
            "$src/python/packaging/$file" >"$out/$file"
    done
    # setup.py itself, as build.sh runs it: the module is package data, so pip would tag the
    # wheel pure Python (setuptools 84 still runs it, with a deprecation warning).
    "$VENV/bin/python" -m pip install --quiet wheel setuptools
    (cd "$out" && "$VENV/bin/python" setup.py -q bdist_wheel --python-tag="$pytag" --plat-name="linux_$ARCH")
}

# What building the bindings needs, from JetPack's apt repository.
ensure_tensorrt_build_deps() {
    if [ "$APT" != 1 ] || ! command -v apt-get >/dev/null; then
        return 0
    fi
    say "installing what building TensorRT's bindings needs (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends cmake make g++ curl \
        "python$(python_version)-dev" libnvinfer-dev libnvinfer-plugin-dev libnvonnxparsers-dev libnvparsers-dev >&2
}

# Make TensorRT and pycuda import in $VENV as TRT_PLAN says, then check that they do.
install_tensorrt() {
    local got
    case "$TRT_PLAN" in
        none|cpu) return 0 ;;
        refuse) die "TensorRT cannot work here: $TRT_WHY" ;;
        apt)
            [ "$APT" = 1 ] || die "python3-libnvinfer is not installed: sudo apt install python3-libnvinfer, or run without --no-apt"
            say "installing JetPack's TensorRT bindings (apt-get install python3-libnvinfer)"
            DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-libnvinfer >&2 ;;
        build)
            ensure_tensorrt_build_deps
            "$VENV/bin/python" -m pip install --quiet "$(build_tensorrt_bindings)" >&2 ;;
    esac
    # pycuda compiles against the CUDA toolkit, which JetPack keeps in /usr/local/cuda, off the paths.
    PATH="$CUDA_ROOT/bin:$PATH" CUDA_ROOT="$CUDA_ROOT" CPATH="$CUDA_ROOT/include${CPATH:+:$CPATH}" \
        LIBRARY_PATH="$CUDA_ROOT/lib64${LIBRARY_PATH:+:$LIBRARY_PATH}" \
        "$VENV/bin/python" -m pip install --quiet 'pycuda>=2022.1' >&2
    got=$("$VENV/bin/python" -c 'import tensorrt, pycuda.driver; print(tensorrt.__version__)' 2>&1) \
        || die "TensorRT or pycuda does not import under $VENV/bin/python: ${got##*$'\n'}"
    case "$got" in
        "$(echo "$TRT_VERSION" | cut -d. -f1-3)"*) say "TensorRT $got and pycuda import under $VENV/bin/python" ;;
        *) die "$VENV/bin/python imports TensorRT $got, but libnvinfer is $TRT_VERSION: remove the other tensorrt from $VENV" ;;
    esac
}

# systemd-python has no binary wheels: it compiles against libsystemd.
systemd_python_buildable() {
    command -v pkg-config >/dev/null && pkg-config --exists libsystemd \
        && command -v cc >/dev/null \
        && [ -e "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]
}

ensure_build_deps() {
    systemd_python_buildable && return 0
    if [ "$APT" = 1 ] && command -v apt-get >/dev/null; then
        local ver
        ver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        say "installing the build dependencies of systemd-python (apt-get)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            libsystemd-dev pkg-config gcc "python${ver}-dev" >&2
    fi
    systemd_python_buildable
}

install_package() {
    local extras=() spec
    # JetPack's own TensorRT bindings live in the system's site packages: the environment sees
    # them only with --system-site-packages (not needed when they are built for it).
    local venv_args=()
    if is_jetson && [ "$CPU_ONLY" = 0 ]; then
        extras+=(jetson)
    fi
    case "$TRT_PLAN" in system|apt) venv_args+=(--system-site-packages) ;; esac
    if ensure_build_deps; then
        extras+=(systemd)
    else
        say "warning: libsystemd headers or a compiler missing: installing without systemd-python"
        say "         (sd_notify still works; journald gets plain text instead of MODEL=/REQUEST_ID= fields)"
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating $VENV"
        mkdir -p "$PREFIX"
        "$PYTHON" -m venv "${venv_args[@]}" "$VENV"
    fi
    install_tensorrt
    spec=${WHEEL:-$REPO}
    [ -e "$spec" ] || die "$spec does not exist"
    if [ ${#extras[@]} -gt 0 ]; then
        spec="${spec}[$(IFS=,; echo "${extras[*]}")]"
    fi
    say "pip install $spec"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade "$spec" >&2
    "$VENV/bin/edged" --help >/dev/null || die "$VENV/bin/edged does not run"
    if [ "$TRT_PLAN" = cpu ]; then
        say "installed for the CPU: $TRT_WHY"
    fi
}

install_system_files() {
    install -d -m 0755 "$SYSUSERS_DIR" "$TMPFILES_DIR" "$UNIT_DIR"
    install -m 0644 "$REPO/systemd/edged.sysusers" "$SYSUSERS_DIR/edged.conf"
    install -m 0644 "$REPO/systemd/edged.tmpfiles" "$TMPFILES_DIR/edged.conf"
    systemd-sysusers "$SYSUSERS_DIR/edged.conf"
    systemd-tmpfiles --create "$TMPFILES_DIR/edged.conf"
    for unit in "${UNITS[@]}"; do
        install -m 0644 "$REPO/systemd/$unit" "$UNIT_DIR/$unit"
    done
    install_apt_hook
    # Every page: the unit's Documentation= names docs/systemd.md, which links to the others.
    for page in "$REPO"/docs/*.md; do
        [ -e "$page" ] && install -D -m 0644 "$page" "$PREFIX/docs/$(basename "$page")"
    done
}

# After a TensorRT, CUDA or L4T upgrade through apt, the hook restarts a running edged: it serves
# on stand-ins within seconds and rebuilds its engines in the background.
install_apt_hook() {
    [ -d "$APT_CONF_DIR" ] || return 0
    install -D -m 0755 "$REPO/systemd/edged-apt-hook" "$APT_HOOK"
    printf '%s\n' \
        "// Installed by edged's scripts/install.sh: rebuild engines after TensorRT/CUDA/L4T upgrades." \
        "DPkg::Post-Invoke { \"if [ -x $APT_HOOK ]; then $APT_HOOK || true; fi\"; };" \
        >"$APT_CONF_DIR/80edged"
    chmod 0644 "$APT_CONF_DIR/80edged"
    EDGED_APT_ACTION=true "$APT_HOOK"  # record the versions installed now
}

install_config() {
    install -d -m 0755 "$CONF_DIR"
    if [ -e "$CONF_DIR/edged.toml" ]; then
        say "keeping $CONF_DIR/edged.toml"
        return 0
    fi
    # 0640 root:edged: the daemon reads it, and an MQTT password in it stays private.
    install -m 0640 -o root -g edged "$REPO/configs/edged.toml" "$CONF_DIR/edged.toml"
    say "installed $CONF_DIR/edged.toml: add your [models.NAME] tables there"
}

start_units() {
    if ! systemd_running; then
        say "systemd is not running here: units installed, not enabled (run: systemctl enable edged.socket edged.service)"
        return 0
    fi
    local was_active=0
    systemctl is-active --quiet edged.service && was_active=1
    systemctl daemon-reload
    if [ "$START" = 1 ]; then
        systemctl enable --now "${UNITS[@]}"
        # enable --now leaves a running daemon on the old code: restart it onto the new one.
        [ "$was_active" = 1 ] && systemctl restart edged.service
        say "edged is $(systemctl is-active edged.service): systemctl status edged; journalctl -u edged"
    else
        systemctl enable "${UNITS[@]}"
        say "enabled; start with: systemctl start edged.socket edged.service"
    fi
}

uninstall() {
    if systemd_running; then
        systemctl disable --now "${UNITS[@]}" 2>/dev/null || true
    fi
    for unit in "${UNITS[@]}"; do
        rm -f "$UNIT_DIR/$unit"
    done
    rm -f "$SYSUSERS_DIR/edged.conf" "$TMPFILES_DIR/edged.conf" "$APT_CONF_DIR/80edged"
    rm -rf "$PREFIX" /run/edged
    if systemd_running; then
        systemctl daemon-reload
        systemctl reset-failed edged.service edged.socket 2>/dev/null || true
    fi
    if [ "$PURGE" = 1 ]; then
        rm -rf "$CONF_DIR" /var/lib/edged /var/cache/edged
        say "removed edged, its config, state and engine cache"
    else
        say "removed edged; kept $CONF_DIR, /var/lib/edged, /var/cache/edged (--purge removes them)"
    fi
    # Never deleted: files anywhere may still belong to it, and a reused uid would inherit them.
    say "the user and group 'edged' stay (userdel edged to remove them)"
}

main() {
    parse_args "$@"
    if [ "$ACTION" = plan ]; then
        print_plan
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "run as root (sudo $0)"
    if [ "$ACTION" = uninstall ]; then
        uninstall
        return 0
    fi
    check_python
    plan_tensorrt
    if [ "$TRT_PLAN" = refuse ]; then
        die "TensorRT cannot work here: $TRT_WHY"
    fi
    install_package
    install_system_files
    install_config
    start_units
}

# Sourced (the unit tests call its functions on fixtures), it defines them and does nothing.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main "$@"
fi
