#!/bin/sh
# shellcheck shell=sh
#
# install.sh - install gpu_preflight on this host.
#
# Copies the gpu_preflight.py that sits next to this script to
# ${DESTDIR}${PREFIX}/bin/gpu_preflight (mode 0755) and, if no config file
# exists yet, an example config to ${DESTDIR}${SYSCONFDIR}/gpu_preflight.conf
# (mode 0644). An existing config file is never overwritten or touched.
#
# The script is idempotent: an identical installed copy is left alone
# ("unchanged"), a different one is replaced atomically (written to a temporary
# name in the same directory, then renamed over). Every command that changes
# something is printed as "+ command" on stderr; --dry-run only prints them.
#
# Usage:
#   sh install.sh [--prefix DIR] [--sysconfdir DIR] [--destdir DIR]
#                 [--no-config] [--no-python-check] [--dry-run] [--quiet]
#   sh install.sh --uninstall [--prefix DIR] [--destdir DIR]
#   sh install.sh --help
#
# Environment (a command-line flag wins over the variable):
#   PREFIX      installation prefix (default /usr/local)
#   SYSCONFDIR  directory for gpu_preflight.conf (default /etc)
#   DESTDIR     staging root prepended to every path, for packaging
#               (default empty: install into the live system)
#
# Examples:
#   sudo sh install.sh                        # /usr/local/bin/gpu_preflight
#   sh install.sh --prefix "$HOME/.local" --sysconfdir "$HOME/.config"
#   sh install.sh --dry-run                   # show what would be done
#   DESTDIR="$pkgdir" PREFIX=/usr sh install.sh --no-python-check
#   sudo sh install.sh --uninstall            # keeps /etc/gpu_preflight.conf
#
# If a SHA256SUMS file sits next to this script, the gpu_preflight.py line in
# it is checked with sha256sum -c before anything is installed.
#
# Exit status: 0 success, 1 error, 2 usage error.
#
# All logic is in functions and the last line calls main, so a truncated
# download of this file runs nothing.

set -eu

usage() {
    cat <<'EOF'
Usage: sh install.sh [OPTIONS]

Install gpu_preflight.py (found next to install.sh) as
${DESTDIR}${PREFIX}/bin/gpu_preflight, plus an example config at
${DESTDIR}${SYSCONFDIR}/gpu_preflight.conf unless one already exists.

Options:
  --prefix DIR        installation prefix (default: $PREFIX or /usr/local)
  --sysconfdir DIR    config directory (default: $SYSCONFDIR or /etc)
  --destdir DIR       staging root for packaging (default: $DESTDIR or empty)
  --no-config         do not install the example config file
  --no-python-check   skip the "python3 >= 3.6 on PATH" check (for packaging
                      on a build host)
  --uninstall         remove the installed script; the config file is kept
  --dry-run           print what would be done, change nothing
  --quiet             print errors only
  -h, --help          show this help and exit

Environment: PREFIX, SYSCONFDIR, DESTDIR (flags take precedence).
Exit status: 0 success, 1 error, 2 usage error.
EOF
}

# ---- Helpers -------------------------------------------------------------

say() {
    if [ "$QUIET" = 0 ]; then
        printf '%s\n' "$1" >&2
    fi
}

# err MESSAGE [HINT_LINE...]: print "install.sh: error: MESSAGE" and any hint
# lines to stderr (even under --quiet), then exit 1.
err() {
    printf 'install.sh: error: %s\n' "$1" >&2
    shift
    for _err_line in "$@"; do
        printf '%s\n' "$_err_line" >&2
    done
    exit 1
}

# usage_err MESSAGE: a usage error; message and usage on stderr, exit 2.
usage_err() {
    printf 'install.sh: %s\n' "$1" >&2
    usage >&2
    exit 2
}

check_cmd() {
    command -v "$1" >/dev/null 2>&1
}

need_cmd() {
    if ! check_cmd "$1"; then
        err "need '$1' (command not found)"
    fi
}

# quote ARG: print ARG quoted for a POSIX shell if it needs quoting.
quote() {
    case $1 in
        '' | *[!A-Za-z0-9_./:=@%+,-]*) ;;
        *)
            printf '%s' "$1"
            return 0
            ;;
    esac
    _q_rest=$1
    _q_out=
    while :; do
        case $_q_rest in
            *"'"*)
                _q_out="${_q_out}${_q_rest%%"'"*}'\\''"
                _q_rest=${_q_rest#*"'"}
                ;;
            *)
                _q_out="${_q_out}${_q_rest}"
                break
                ;;
        esac
    done
    printf "'%s'" "$_q_out"
}

# show_line TEXT: print one "+ command" line to stderr. Under --dry-run these
# lines are the whole point, so they are printed even with --quiet.
show_line() {
    if [ "$DRY_RUN" = 1 ] || [ "$QUIET" = 0 ]; then
        printf '%s\n' "$1" >&2
    fi
}

# cmd_line ARG...: print "+ ARG..." with each ARG shell-quoted as needed.
cmd_line() {
    _cl_line='+'
    for _cl_arg in "$@"; do
        _cl_line="$_cl_line $(quote "$_cl_arg")"
    done
    printf '%s' "$_cl_line"
}

show_cmd() {
    show_line "$(cmd_line "$@")"
}

# run CMD ARG...: print a state-changing command, then run it (unless
# --dry-run). Dies if the command fails.
run() {
    show_cmd "$@"
    if [ "$DRY_RUN" = 1 ]; then
        return 0
    fi
    if ! "$@"; then
        err "command failed: $*"
    fi
}

# run_to FILE CMD ARG...: like run, with stdout redirected to FILE.
run_to() {
    _rt_file=$1
    shift
    show_line "$(cmd_line "$@") > $(quote "$_rt_file")"
    if [ "$DRY_RUN" = 1 ]; then
        return 0
    fi
    if ! "$@" >"$_rt_file"; then
        err "command failed: $* > $_rt_file"
    fi
}

# done_msg WORD PATH: report an outcome; under --dry-run say "would WORD".
done_msg() {
    if [ "$DRY_RUN" = 1 ]; then
        say "would $1: $2"
    else
        case $1 in
            install) say "installed: $2" ;;
            update) say "updated: $2" ;;
            remove) say "removed: $2" ;;
            *) say "$1: $2" ;;
        esac
    fi
}

# Remove temporary files left behind by an interrupted or failed run.
cleanup() {
    if [ "$DRY_RUN" = 1 ]; then
        return 0
    fi
    if [ -n "${TMP_SCRIPT:-}" ] && [ -e "$TMP_SCRIPT" ]; then
        rm -f "$TMP_SCRIPT"
    fi
    if [ -n "${TMP_CONFIG:-}" ] && [ -e "$TMP_CONFIG" ]; then
        rm -f "$TMP_CONFIG"
    fi
}

# ensure_dir DIR: create DIR (mode 0755) if it does not exist yet. An
# existing directory is left exactly as it is.
ensure_dir() {
    if [ ! -d "$1" ]; then
        run install -d -m 0755 "$1"
    fi
}

# check_writable DIR: fail early, with a hint, if DIR (or the nearest
# existing parent that would hold it) is not writable.
check_writable() {
    _cw_dir=$1
    while [ ! -d "$_cw_dir" ]; do
        case $_cw_dir in
            */*) _cw_dir=${_cw_dir%/*} ;;
            *) _cw_dir=. ;;
        esac
        if [ -z "$_cw_dir" ]; then
            _cw_dir=/
        fi
    done
    if [ ! -w "$_cw_dir" ]; then
        if [ "$DRY_RUN" = 1 ]; then
            say "note: $_cw_dir is not writable by this user; a real run would fail"
        else
            err "cannot write to $_cw_dir" \
                "  Run as root (sudo sh install.sh), or install for this user:" \
                "    sh install.sh --prefix \"\$HOME/.local\" --sysconfdir \"\$HOME/.config\""
        fi
    fi
}

# ---- Steps ---------------------------------------------------------------

parse_args() {
    while [ $# -gt 0 ]; do
        case $1 in
            -h | --help)
                usage
                exit 0
                ;;
            --prefix | --sysconfdir | --destdir)
                if [ $# -lt 2 ]; then
                    usage_err "option $1 requires an argument"
                fi
                set_dir_option "$1" "$2"
                shift
                ;;
            --prefix=* | --sysconfdir=* | --destdir=*)
                set_dir_option "${1%%=*}" "${1#*=}"
                ;;
            --no-config) NO_CONFIG=1 ;;
            --no-python-check) NO_PYTHON_CHECK=1 ;;
            --uninstall) UNINSTALL=1 ;;
            --dry-run) DRY_RUN=1 ;;
            --quiet | -q) QUIET=1 ;;
            --)
                shift
                if [ $# -gt 0 ]; then
                    usage_err "unexpected argument: $1"
                fi
                break
                ;;
            -*) usage_err "unknown option: $1" ;;
            *) usage_err "unexpected argument: $1" ;;
        esac
        shift
    done
}

set_dir_option() {
    case $1 in
        --prefix) PREFIX=$2 ;;
        --sysconfdir) SYSCONFDIR=$2 ;;
        --destdir) DESTDIR=$2 ;;
    esac
}

# Normalise and validate PREFIX, SYSCONFDIR and DESTDIR; derive the paths.
resolve_paths() {
    case $PREFIX in
        /*) ;;
        *) usage_err "PREFIX must be an absolute path, got '$PREFIX'" ;;
    esac
    case $SYSCONFDIR in
        /*) ;;
        *) usage_err "SYSCONFDIR must be an absolute path, got '$SYSCONFDIR'" ;;
    esac
    # Strip trailing slashes so that the joined paths stay clean.
    while [ "${PREFIX%/}" != "$PREFIX" ]; do PREFIX=${PREFIX%/}; done
    while [ "${SYSCONFDIR%/}" != "$SYSCONFDIR" ]; do SYSCONFDIR=${SYSCONFDIR%/}; done
    while [ "${DESTDIR%/}" != "$DESTDIR" ]; do DESTDIR=${DESTDIR%/}; done

    BINDIR="${DESTDIR}${PREFIX}/bin"
    TARGET="${BINDIR}/gpu_preflight"
    CONFDIR="${DESTDIR}${SYSCONFDIR}"
    if [ -z "$CONFDIR" ]; then
        CONFDIR=/
    fi
    CONFIG="${DESTDIR}${SYSCONFDIR}/gpu_preflight.conf"
}

find_source() {
    SRCDIR=$(dirname "$0")
    SOURCE="${SRCDIR}/gpu_preflight.py"
    if [ ! -f "$SOURCE" ]; then
        err "gpu_preflight.py not found next to install.sh (looked for $SOURCE)" \
            "  install.sh installs the gpu_preflight.py that sits in the same directory;" \
            "  copy both files to one directory and run: sh install.sh"
    fi
    if [ ! -r "$SOURCE" ]; then
        err "cannot read $SOURCE"
    fi
}

# If a SHA256SUMS file ships next to install.sh, verify gpu_preflight.py.
verify_checksum() {
    _vc_sums="${SRCDIR}/SHA256SUMS"
    if [ ! -f "$_vc_sums" ]; then
        return 0
    fi
    need_cmd sha256sum
    need_cmd grep
    if ! _vc_line=$(grep -E '^[0-9a-fA-F]{64} [ *]gpu_preflight\.py$' "$_vc_sums"); then
        err "$_vc_sums has no line for gpu_preflight.py"
    fi
    if ! printf '%s\n' "$_vc_line" | (cd "$SRCDIR" && sha256sum -c - >/dev/null 2>&1); then
        err "checksum mismatch for $SOURCE (per $_vc_sums)" \
            "  The file may be corrupt or modified; fetch it again."
    fi
    say "checksum ok: $SOURCE"
}

python_hint() {
    err "$1" \
        "  gpu_preflight needs Python 3.6 or newer as 'python3' on PATH. Install it with:" \
        "    RHEL/Rocky/Alma 8:  dnf install python3" \
        "    SLES 15:            zypper install python3" \
        "    Debian/Ubuntu:      apt-get install python3" \
        "  (On RHEL 8, /usr/libexec/platform-python is reserved for system tools.)" \
        "  Or point the script at another Python 3.6+ interpreter by editing the first" \
        "  line of the installed file (#!/usr/bin/env python3), or of gpu_preflight.py" \
        "  before installing so that a reinstall keeps it; then rerun with" \
        "  --no-python-check."
}

check_python() {
    if ! _cp_path=$(command -v python3 2>/dev/null); then
        python_hint "python3 not found on PATH"
    fi
    if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 6))' \
        >/dev/null 2>&1 </dev/null; then
        if ! _cp_version=$(python3 -c 'import sys; print(sys.version.split()[0])' \
            2>/dev/null </dev/null); then
            _cp_version="(version unknown)"
        fi
        python_hint "python3 at $_cp_path is $_cp_version; Python 3.6 or newer is required"
    fi
}

install_script() {
    if [ -f "$TARGET" ] && [ -x "$TARGET" ] && cmp -s "$SOURCE" "$TARGET"; then
        say "unchanged: $TARGET"
        return 0
    fi
    check_writable "$BINDIR"
    if [ -e "$TARGET" ] || [ -L "$TARGET" ]; then
        _is_word=update
    else
        _is_word=install
    fi
    ensure_dir "$BINDIR"
    TMP_SCRIPT="${BINDIR}/.gpu_preflight.tmp.$$"
    run install -m 0755 "$SOURCE" "$TMP_SCRIPT"
    run mv -f "$TMP_SCRIPT" "$TARGET"
    TMP_SCRIPT=
    done_msg "$_is_word" "$TARGET"
}

example_config() {
    cat <<'EOF'
# gpu_preflight.conf - example configuration for gpu_preflight.
#
# Every setting below is commented out, so the built-in defaults apply until
# you uncomment and edit one. See "gpu_preflight --help" for their meaning.
# Precedence: command-line flags > GPU_PREFLIGHT_* environment variables > this file > built-in defaults.
#
# install.sh created this file because none existed; it never overwrites or
# removes it afterwards.

[gpu_preflight]
# host = http://127.0.0.1:11434
# model = llama3.2
# timeout = 3
# deadline = 10
# warmup = token
# keep-alive = 10m
# syslog-facility = user
EOF
}

install_config() {
    if [ -e "$CONFIG" ] || [ -L "$CONFIG" ]; then
        say "kept existing config: $CONFIG"
        return 0
    fi
    check_writable "$CONFDIR"
    ensure_dir "$CONFDIR"
    TMP_CONFIG="${CONFDIR%/}/.gpu_preflight.conf.tmp.$$"
    run_to "$TMP_CONFIG" example_config
    run chmod 0644 "$TMP_CONFIG"
    run mv -f "$TMP_CONFIG" "$CONFIG"
    TMP_CONFIG=
    done_msg install "$CONFIG"
}

# Run the installed script once, but only when it sits at its final path.
smoke_test() {
    if [ -n "$DESTDIR" ]; then
        return 0
    fi
    if [ "$DRY_RUN" = 1 ]; then
        show_cmd "$TARGET" --version
        return 0
    fi
    show_cmd "$TARGET" --version
    if ! _st_out=$("$TARGET" --version </dev/null 2>&1); then
        err "$TARGET was installed but '$TARGET --version' failed:" "$_st_out"
    fi
    say "$_st_out"
}

uninstall() {
    if [ -e "$TARGET" ] || [ -L "$TARGET" ]; then
        check_writable "$BINDIR"
        run rm -f "$TARGET"
        done_msg remove "$TARGET"
    else
        say "not installed: $TARGET"
    fi
    if [ "$NO_CONFIG" = 0 ] && { [ -e "$CONFIG" ] || [ -L "$CONFIG" ]; }; then
        say "kept config: $CONFIG (remove it by hand if it is no longer wanted)"
    fi
}

main() {
    PREFIX=${PREFIX:-/usr/local}
    SYSCONFDIR=${SYSCONFDIR:-/etc}
    DESTDIR=${DESTDIR:-}
    NO_CONFIG=0
    NO_PYTHON_CHECK=0
    UNINSTALL=0
    DRY_RUN=0
    QUIET=0
    TMP_SCRIPT=
    TMP_CONFIG=

    parse_args "$@"
    resolve_paths
    umask 022
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM

    need_cmd install
    need_cmd cmp
    need_cmd mv
    need_cmd rm
    need_cmd chmod
    need_cmd dirname
    need_cmd cat

    if [ "$DRY_RUN" = 1 ]; then
        say "dry run: nothing will be changed"
    fi

    if [ "$UNINSTALL" = 1 ]; then
        uninstall
        return 0
    fi

    find_source
    verify_checksum
    if [ "$NO_PYTHON_CHECK" = 0 ]; then
        check_python
    fi
    install_script
    if [ "$NO_CONFIG" = 0 ]; then
        install_config
    fi
    smoke_test
}

main "$@"
