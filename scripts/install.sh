#!/usr/bin/env bash
# Install edged as a systemd service (docs/systemd.md explains every step).
#
#   sudo scripts/install.sh                    # install or upgrade from this checkout, start it
#   sudo scripts/install.sh --wheel edged.whl  # from a wheel instead of the checkout
#   sudo scripts/install.sh --no-start         # install and enable, start at next boot
#   sudo scripts/install.sh --uninstall        # remove the service, keep config, engines, user
#   sudo scripts/install.sh --uninstall --purge  # ... and remove config, state and engines too
#
# Idempotent: running it again upgrades the package, keeps /etc/edged/edged.toml as the
# operator left it, and restarts the service if it was running.
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

say() { printf 'install.sh: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

usage() {
    sed -n '2,11s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
    cat <<EOF
Options:
  --wheel PATH      install this wheel instead of the checkout at $REPO
  --python PATH     interpreter for the virtual environment (default: /usr/bin/python3; 3.10+)
  --unit-dir DIR    where the units go (default: $UNIT_DIR; /usr/local/lib/systemd/system works)
  --no-start        enable the units but do not start them now
  --no-apt          never apt-get the build dependencies of systemd-python
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

is_jetson() { [ -e /etc/nv_tegra_release ]; }

check_python() {
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found (use --python)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "$PYTHON is $("$PYTHON" -V 2>&1); edged needs Python 3.10+ (JetPack 5: install python3.10 and pass --python)"
    "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null \
        || die "$PYTHON cannot create virtual environments (apt-get install python3-venv)"
    local real
    real=$("$PYTHON" -c 'import os, sys; print(os.path.realpath(sys.executable))')
    case "$real" in
        /root/*|/home/*|/run/user/*)
            die "$PYTHON is $real, which edged.service cannot run (ProtectHome=yes hides it); use --python /usr/bin/python3.X" ;;
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
    # Jetson: TensorRT's Python bindings come from JetPack's apt packages, not PyPI, so the
    # environment must see the system site-packages.
    local venv_args=()
    if is_jetson; then
        extras+=(jetson)
        venv_args+=(--system-site-packages)
    fi
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
    spec=${WHEEL:-$REPO}
    [ -e "$spec" ] || die "$spec does not exist"
    if [ ${#extras[@]} -gt 0 ]; then
        spec="${spec}[$(IFS=,; echo "${extras[*]}")]"
    fi
    say "pip install $spec"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade "$spec" >&2
    "$VENV/bin/edged" --help >/dev/null || die "$VENV/bin/edged does not run"
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
    [ "$(id -u)" = 0 ] || die "run as root (sudo $0)"
    if [ "$ACTION" = uninstall ]; then
        uninstall
        return 0
    fi
    check_python
    install_package
    install_system_files
    install_config
    start_units
}

main "$@"
