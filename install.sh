#!/bin/sh
# shellcheck shell=sh
#
# install.sh - install the gpu_preflight.py beside it in its fast layout: the
# module with its bytecode cache in PREFIX/lib/gpu_preflight, a launcher that
# runs it in PREFIX/bin, an example config in SYSCONFDIR unless one exists.
#
#   sudo sh install.sh [--prefix DIR] [--dry-run] [--uninstall] [OPTION ...]
#
# Every option: usage() below, or sh install.sh --help. What it refuses as
# root, and why: README.md, "Install, in detail". MIT License (see LICENSE).

# POSIX sh has no `local`: every variable is global. A function's own start
# with _ and a prefix no other function uses (_fp_ in find_python), so a call
# never overwrites its caller's; what functions share is UPPERCASE.

set -eu

main() {
    PREFIX=${PREFIX:-/usr/local}
    SYSCONFDIR=${SYSCONFDIR:-/etc}
    DESTDIR=${DESTDIR:-}
    PYTHON=
    NO_CONFIG=0
    NO_PYTHON_CHECK=0
    UNINSTALL=0
    DRY_RUN=0
    QUIET=0
    VERBOSE=0
    TMP=

    parse_args "$@"
    resolve_paths
    umask 022
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    for _mn_cmd in install cmp mv rm rmdir chmod cat ls dirname grep sed id readlink; do
        need_cmd "$_mn_cmd"
    done
    if [ "$DRY_RUN" = 1 ]; then
        say "dry run: nothing will be changed"
    fi

    if [ "$UNINSTALL" = 1 ]; then
        uninstall
        return 0
    fi
    find_source
    verify_checksum
    find_python
    if [ "$(id -u)" = 0 ]; then
        check_others_can_run
    fi
    if [ -z "$DESTDIR" ] && [ "$(id -u)" = 0 ]; then
        check_trust
    fi
    for _mn_path in "$TARGET" "$MODULE" "$PYC"; do # mv -f would move into it
        if [ -d "$_mn_path" ]; then
            err "$_mn_path is a directory (or a link to one); remove it first"
        fi
    done
    install_module
    install_launcher
    if [ "$NO_CONFIG" = 0 ]; then
        install_config
    fi
    smoke_test
}

usage() {
    cat <<'EOF'
Usage: sh install.sh [OPTIONS]

Install gpu_preflight.py (found next to install.sh) as
${DESTDIR}${PREFIX}/lib/gpu_preflight/gpu_preflight.py with its bytecode
cache, the command ${DESTDIR}${PREFIX}/bin/gpu_preflight (a launcher that
runs it with the checked python3), and an example config at
${DESTDIR}${SYSCONFDIR}/gpu_preflight.conf unless one already exists.

Options:
  --prefix DIR        installation prefix (default: $PREFIX or /usr/local)
  --sysconfdir DIR    config directory (default: $SYSCONFDIR or /etc)
  --destdir DIR       staging root for packaging (default: $DESTDIR or empty)
  --python PATH       the Python 3.6+ the command runs with (default: the
                      first 3.6+ of /usr/bin/python3, /usr/local/bin/python3,
                      python3 on PATH); it also writes the bytecode cache.
                      Run as root, install.sh refuses a default one that
                      other users cannot run; one named here gets a warning
  --no-config         do not install the example config file
  --no-python-check   do not run Python at all: no version check and no
                      bytecode cache (the first run writes it); needs
                      --python, the interpreter the launcher names (a name
                      found on PATH may be a pyenv shim or a wrapper)
  --uninstall         remove the command, the module and its cache; the
                      config file is kept
  --dry-run           print the commands it would run, change nothing
  -v, --verbose       also print each command it runs, as "+ command"
  -q, --quiet         print errors and warnings only
  -h, --help          show this help and exit

Environment: PREFIX, SYSCONFDIR, DESTDIR (flags take precedence).
A SHA256SUMS file next to install.sh is checked (sha256sum -c) first.
Exit status: 0 success, 1 error, 2 usage error.
EOF
}

# ---- Steps ------------------------------------------------------------------

parse_args() {
    while [ $# -gt 0 ]; do
        case $1 in
            -h | --help)
                usage
                exit 0
                ;;
            --prefix | --sysconfdir | --destdir | --python)
                if [ $# -lt 2 ]; then
                    usage_err "option $1 requires an argument"
                fi
                set_option "$1" "$2"
                shift
                ;;
            --prefix=* | --sysconfdir=* | --destdir=* | --python=*)
                set_option "${1%%=*}" "${1#*=}"
                ;;
            --no-config) NO_CONFIG=1 ;;
            --no-python-check) NO_PYTHON_CHECK=1 ;;
            --uninstall) UNINSTALL=1 ;;
            --dry-run) DRY_RUN=1 ;;
            --verbose | -v) VERBOSE=1 ;;
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
    if [ "$NO_PYTHON_CHECK" = 1 ] && [ -z "$PYTHON" ]; then
        usage_err "--no-python-check needs --python PATH (the interpreter the launcher names)"
    fi
}

set_option() {
    case $1 in
        --prefix) PREFIX=$2 ;;
        --sysconfdir) SYSCONFDIR=$2 ;;
        --destdir) DESTDIR=$2 ;;
        --python) PYTHON=$2 ;;
    esac
}

# Validate PREFIX and SYSCONFDIR; derive every path from them and DESTDIR.
resolve_paths() {
    case $PREFIX in
        /*) ;;
        *) usage_err "PREFIX must be an absolute path, got '$PREFIX'" ;;
    esac
    case $SYSCONFDIR in
        /*) ;;
        *) usage_err "SYSCONFDIR must be an absolute path, got '$SYSCONFDIR'" ;;
    esac
    # PREFIX goes into the launcher as a Python string: printable ASCII only
    # (a carriage return or a byte that is not UTF-8 makes it unreadable).
    if ! (LC_ALL=C && case $PREFIX in *[\"\\]* | *[![:print:]]*) exit 1 ;; esac); then
        usage_err "PREFIX must not contain a quote, a backslash or a character that is not printable ASCII"
    fi
    while [ "${PREFIX%/}" != "$PREFIX" ]; do PREFIX=${PREFIX%/}; done
    while [ "${SYSCONFDIR%/}" != "$SYSCONFDIR" ]; do SYSCONFDIR=${SYSCONFDIR%/}; done
    while [ "${DESTDIR%/}" != "$DESTDIR" ]; do DESTDIR=${DESTDIR%/}; done

    BINDIR="${DESTDIR}${PREFIX}/bin"
    TARGET="${BINDIR}/gpu_preflight"
    LIB="${PREFIX}/lib/gpu_preflight"       # as the launcher sees it
    LIBDIR="${DESTDIR}${LIB}"
    MODULE="${LIBDIR}/gpu_preflight.py"
    CACHEDIR="${LIBDIR}/__pycache__"
    CONFIG="${DESTDIR}${SYSCONFDIR}/gpu_preflight.conf"
    CONFDIR=${CONFIG%/*}
    CONFDIR=${CONFDIR:-/}
}

find_source() {
    SRCDIR=$(cd "$(dirname "$0")" && pwd) # absolute: --dry-run output replays anywhere
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
    if ! _vc_line=$(grep -E '^[0-9a-fA-F]{64} [ *]gpu_preflight\.py$' "$_vc_sums"); then
        err "$_vc_sums has no line for gpu_preflight.py"
    fi
    if ! printf '%s\n' "$_vc_line" | (cd "$SRCDIR" && sha256sum -c - >/dev/null 2>&1); then
        err "checksum mismatch for $SOURCE (per $_vc_sums)" \
            "  The file may be corrupt or modified; fetch it again."
    fi
    say "checksum ok: $SOURCE"
}

# Set PYTHON to the absolute path of the interpreter the launcher names, PYC
# to the cache file it reads (empty under --no-python-check), HASHED to 1
# where that is a checked-hash pyc, and PY_PATHS to where it runs code from:
# its real path, its standard library, site-packages. Without --python the
# system's python3 comes first: the one on PATH may be a pyenv, conda or
# virtual environment of one user. Root runs a candidate only once no other
# user could have changed it.
find_python() {
    PYC=
    HASHED=0
    PY_PATHS=
    PY_GIVEN=0
    if [ -n "$PYTHON" ]; then
        PY_GIVEN=1
    fi
    if [ "$NO_PYTHON_CHECK" = 1 ]; then
        check_shebang "$PYTHON"
        return 0
    fi
    if [ -n "$PYTHON" ]; then
        case $PYTHON in
            /*) _fp_found=$PYTHON ;;
            */*) _fp_found=$(pwd)/$PYTHON ;;
            *) _fp_found=$(on_path "$PYTHON") || _fp_found= ;;
        esac
        if [ ! -e "$_fp_found" ]; then
            python_hint "$PYTHON not found"
        fi
        trust_to_run "$_fp_found"
        probe_python "$_fp_found" || too_old "$_fp_found"
    else
        _fp_found=
        _fp_old=
        for _fp_try in /usr/bin/python3 /usr/local/bin/python3 \
            "$(on_path python3 || :)"; do
            if [ -n "$_fp_try" ] && [ -e "$_fp_try" ]; then
                trust_to_run "$_fp_try"
                if probe_python "$_fp_try"; then
                    _fp_found=$_fp_try
                    break
                fi
                _fp_old=${_fp_old:-$_fp_try}
            fi
        done
        if [ -z "$_fp_found" ] && [ -n "$_fp_old" ]; then
            too_old "$_fp_old"
        elif [ -z "$_fp_found" ]; then
            python_hint "python3 not found (not in /usr/bin, /usr/local/bin or on PATH)"
        fi
    fi
    PYTHON=$(printf '%s\n' "$PY_INFO" | sed -n 1p)
    PYC="${CACHEDIR}/gpu_preflight.$(printf '%s\n' "$PY_INFO" | sed -n 2p).pyc"
    HASHED=$(printf '%s\n' "$PY_INFO" | sed -n 3p)
    PY_PATHS=$(printf '%s\n' "$PY_INFO" | sed -n '4,$p')
    check_shebang "$PYTHON"
    if [ "$PYTHON" != "$_fp_found" ]; then # a wrapper's: root compiles with it
        trust_to_run "$PYTHON"
    fi
}

# on_path NAME: the first DIR/NAME on PATH that is an executable file, DIR
# absolute: an empty or relative entry means the working directory, and root
# must not run what another user left there ("command -v" would name it).
on_path() {
    _op_rest=${PATH:-}:
    while [ -n "$_op_rest" ]; do
        _op_dir=${_op_rest%%:*}
        _op_rest=${_op_rest#*:}
        case $_op_dir in
            /*)
                if [ -f "${_op_dir%/}/$1" ] && [ -x "${_op_dir%/}/$1" ]; then
                    printf '%s\n' "${_op_dir%/}/$1"
                    return 0
                fi
                ;;
        esac
    done
    return 1
}

# trust_to_run PATH: as root, refuse to run PATH (to learn its version) unless
# no other user could have changed it: each link on its way and the file it
# leads to must pass check_trusted.
trust_to_run() {
    if [ "$(id -u)" != 0 ]; then
        return 0
    fi
    if ! _tt_walk=$(walk_path "$1"); then
        err "$1: more than 40 links on its way"
    fi
    while IFS= read -r _tt_path; do
        if [ -L "$_tt_path" ]; then
            check_trusted "$_tt_path" "the interpreter $1"
        fi
    done <<EOF
$_tt_walk
EOF
    check_trusted "$(printf '%s\n' "$_tt_walk" | sed -n '$p')" "the interpreter $1"
}

# probe_python PATH: true when PATH runs Python 3.6 or newer; PY_INFO is
# then what find_python reads. sys.executable, not PATH: a pyenv shim or a
# wrapper script could later pick an interpreter the cache does not match.
probe_python() {
    PY_INFO=$("$1" -I -c 'import os, site, sys
if sys.version_info >= (3, 6):
    print(sys.executable)
    print(sys.implementation.cache_tag)
    print(int(sys.version_info >= (3, 7)))
    print(os.path.realpath(sys.executable))
    print(os.path.dirname(os.__file__))
    print("\n".join(getattr(site, "getsitepackages", list)()))' 2>/dev/null </dev/null) \
        && [ -n "$PY_INFO" ]
}

too_old() {
    if ! _to_version=$("$1" -c 'import sys; print(sys.version.split()[0])' \
        2>/dev/null </dev/null); then
        _to_version="(version unknown)"
    fi
    python_hint "$1 is Python $_to_version; 3.6 or newer is required"
}

# Root installs a command for every user, so its #! line must name an
# interpreter they can all run, not a pyenv under /root (mode 0700): there
# exec fails with "Permission denied" or ld.so's "cannot open shared object
# file". A default one they cannot run is refused; one that --python names
# only draws a warning, for its owner may want it so.
check_others_can_run() {
    if [ ! -e "$PYTHON" ]; then
        return 0 # --no-python-check for another host: nothing here to judge
    fi
    _oc_why=$(closed_to_others "$PYTHON")
    if [ -z "$_oc_why" ] && [ "$NO_PYTHON_CHECK" = 0 ]; then
        _oc_why=$(fails_for_nobody "$PYTHON")
    fi
    if [ -z "$_oc_why" ]; then
        return 0
    elif [ "$PY_GIVEN" = 1 ]; then
        warn "other users cannot run $PYTHON ($_oc_why): the command will fail for them"
    else
        err "other users cannot run $PYTHON ($_oc_why); install a python3 in /usr/bin, or name one they can run with --python PATH (--python $PYTHON to use this one anyway)"
    fi
}

# closed_to_others PATH: why other users cannot run the file at PATH, or
# nothing when they can: they must be able to search (x) / and each
# directory on its way, link by link, and execute the file it leads to.
closed_to_others() {
    if ! _co_walk=$(walk_path "$1"); then
        printf 'more than 40 links on its way'
        return 0
    fi
    while IFS= read -r _co_path; do
        if [ -L "$_co_path" ] || [ ! -e "$_co_path" ]; then
            continue # where a link leads comes next
        fi
        _co_mode=$(file_mode "$_co_path")
        case $_co_mode in
            ?????????[xt]) ;;
            *)
                printf '%s is %s' "$_co_path" "$_co_mode"
                return 0
                ;;
        esac
    done <<EOF
/
$_co_walk
EOF
}

# fails_for_nobody PYTHON: why PYTHON does not start as user nobody (uid
# 65534), or nothing when it does, or when setpriv is missing or cannot
# switch users here. It finds what modes do not show: a libpython or a
# standard library closed to others, an ACL. A shell runs it, as cron's
# would: setpriv's own exec still has root's reach.
fails_for_nobody() {
    _fn_python=$1
    if ! _fn_setpriv=$(on_path setpriv); then
        return 0
    fi
    set -- "$_fn_setpriv" --reuid=65534 --regid=65534 --clear-groups /bin/sh -c
    _fn_rc=0
    # shellcheck disable=SC2016 # the inner shell expands "$1"
    _fn_out=$(cd / && "$@" 'exec "$1" -I -c ""' sh "$_fn_python" 2>&1 </dev/null) || _fn_rc=$?
    if [ "$_fn_rc" != 0 ] && (cd / && "$@" : >/dev/null 2>&1 </dev/null); then
        _fn_out=$(printf '%s\n' "$_fn_out" | sed -n 1p)
        printf 'as uid 65534 it fails: %s' "${_fn_out:-exit status $_fn_rc}"
    fi
}

# walk_path PATH: each path that a lookup of the absolute PATH visits, as
# the kernel's does: each directory and each link on its way (a link's
# target, read in the link's directory, comes next), the file last. It
# fails after 40 links, as the kernel does.
walk_path() {
    _wp_done=
    _wp_rest=$1
    _wp_links=0
    while [ -n "$_wp_rest" ]; do
        _wp_name=${_wp_rest%%/*}
        case $_wp_rest in
            */*) _wp_rest=${_wp_rest#*/} ;;
            *) _wp_rest= ;;
        esac
        case $_wp_name in
            '' | .) continue ;;
            ..)
                _wp_done=${_wp_done%/*}
                continue
                ;;
        esac
        printf '%s\n' "$_wp_done/$_wp_name"
        if [ -L "$_wp_done/$_wp_name" ]; then
            _wp_links=$((_wp_links + 1))
            if [ "$_wp_links" -gt 40 ]; then
                return 1
            fi
            _wp_to=$(readlink "$_wp_done/$_wp_name")
            case $_wp_to in
                /*) _wp_done= ;;
            esac
            _wp_rest=$_wp_to/$_wp_rest
        else
            _wp_done=$_wp_done/$_wp_name
        fi
    done
}

# Root's every run executes the launcher, the module and the interpreter with
# its library: refuse to install when another user could change any of them.
check_trust() {
    check_trusted "$BINDIR" "$TARGET"
    check_trusted "$LIBDIR" "$MODULE"
    while IFS= read -r _ct_path; do
        if [ -n "$_ct_path" ]; then
            check_trusted "$_ct_path" "the interpreter $PYTHON"
        fi
    done <<EOF
$PYTHON
$PY_PATHS
EOF
}

check_shebang() {
    case $1 in
        *[[:space:]]*) err "the interpreter path '$1' has a blank: it cannot go on a #! line" ;;
        /*) ;;
        *) err "the interpreter path '$1' is not absolute" ;;
    esac
}

python_hint() {
    err "$1" \
        "  gpu_preflight needs Python 3.6 or newer, best the system's /usr/bin/python3. Install it with:" \
        "    RHEL/Rocky/Alma 8:  dnf install python3" \
        "    SLES 15:            zypper install python3" \
        "    Debian/Ubuntu:      apt-get install python3" \
        "  (On RHEL 8, /usr/libexec/platform-python is reserved for system tools.)" \
        "  Or name another Python 3.6+ interpreter: sh install.sh --python /path/to/python3"
}

# The module and its bytecode cache, written by the launcher's interpreter as
# Python itself would (same file name, same invalidation check) but naming the
# final path as its source. A new module is compiled in a staging directory
# beside it first: a source that does not compile replaces nothing. A cache
# another interpreter (or -O) left is removed, unless --no-python-check finds
# the module unchanged.
install_module() {
    _im_same=0
    if own_file "$MODULE" -rw-r--r-- && cmp -s "$SOURCE" "$MODULE"; then
        _im_same=1
    fi
    for _im_pyc in "$CACHEDIR"/gpu_preflight.*.pyc; do
        if [ -e "$_im_pyc" ] && [ "$_im_pyc" != "$PYC" ] \
            && { [ -n "$PYC" ] || [ "$_im_same" = 0 ]; }; then
            run rm -f "$_im_pyc"
            done_msg remove "$_im_pyc"
        fi
    done
    check_writable "$LIBDIR"
    own_dir "$LIBDIR"
    own_dir "$CACHEDIR" # else the first run creates it, with that run's umask
    _im_word=$(install_word "$PYC")
    if [ "$_im_same" = 1 ]; then
        say "unchanged: $MODULE"
        if [ -n "$PYC" ] && own_file "$PYC" -rw-r--r-- && cache_is_valid; then
            say "unchanged: $PYC"
        elif [ -n "$PYC" ]; then
            compile "$MODULE"
            done_msg "$_im_word" "$PYC"
        fi
    else
        _im_mword=$(install_word "$MODULE")
        TMP="${LIBDIR}/.gpu_preflight.tmp.$$"
        run install -d -m 0755 "$TMP"
        run install -m 0644 "$SOURCE" "$TMP/gpu_preflight.py"
        if [ -n "$PYC" ]; then
            compile "$TMP/gpu_preflight.py"
        fi
        run mv -f "$TMP/gpu_preflight.py" "$MODULE"
        done_msg "$_im_mword" "$MODULE"
        if [ -n "$PYC" ]; then
            run mv -f "$TMP/__pycache__/${PYC##*/}" "$PYC"
            run rmdir "$TMP/__pycache__"
            done_msg "$_im_word" "$PYC"
        fi
        run rmdir "$TMP"
        TMP=
    fi
    if [ -z "$PYC" ]; then
        say "no bytecode cache (--no-python-check): the first run writes it"
    fi
}

# compile FILE: write the cache of FILE into the __pycache__ beside it. On
# Python 3.7+ it is a checked-hash pyc, valid whatever a package manager does
# to timestamps; 3.6 has only timestamp pycs, which the first run as root
# rewrites if the module's mtime changed.
compile() {
    if [ "$HASHED" = 1 ]; then
        run "$PYTHON" -I -m compileall -q -f -d "$LIB" --invalidation-mode checked-hash "$1"
    else
        run "$PYTHON" -I -m compileall -q -f -d "$LIB" "$1"
    fi
}

# True when Python would load PYC for MODULE (on 3.7+ as a checked-hash pyc:
# one of another kind may hold other code) and the code in it is the
# module's, compiled with the final path as its source name.
cache_is_valid() {
    "$PYTHON" -I -c 'import importlib.util, marshal, os, sys
module, pyc, final = sys.argv[1:]
with open(module, "rb") as handle:
    source = handle.read()
with open(pyc, "rb") as handle:
    data = handle.read()
if sys.version_info >= (3, 7):
    head = b"\3\0\0\0" + importlib.util.source_hash(source)
else:
    info = os.stat(module)
    head = b"".join((int(n) & 0xFFFFFFFF).to_bytes(4, "little")
                    for n in (info.st_mtime, info.st_size))
head = importlib.util.MAGIC_NUMBER + head
code = marshal.loads(data[len(head):]) if data.startswith(head) else None
sys.exit(code != compile(source, final, "exec", dont_inherit=True)
         or code.co_filename != final)' "$MODULE" "$PYC" "${LIB}/gpu_preflight.py" \
        >/dev/null 2>&1 </dev/null
}

# The launcher; it also replaces an older install's whole script in bin/.
install_launcher() {
    _il_text=$(launcher)
    if own_file "$TARGET" -rwxr-xr-x && printf '%s\n' "$_il_text" | cmp -s - "$TARGET"; then
        say "unchanged: $TARGET (python3: $PYTHON)"
        return 0
    fi
    check_writable "$BINDIR"
    ensure_dir "$BINDIR"
    _il_word=$(install_word "$TARGET")
    _il_was=
    if [ -f "$TARGET" ] && grep -q '^__version__ = ' "$TARGET"; then
        _il_was="; was the whole script, now a launcher of $LIB"
    fi
    put "$TARGET" 0755 "$_il_text"
    done_msg "$_il_word" "$TARGET (python3: $PYTHON$_il_was)"
}

# The command: the module, imported from its cache by the interpreter that
# wrote it (-I: no PYTHON* variables, no user site, no script dir on sys.path).
# process_started(): --deadline counts from process start, as for the script.
launcher() {
    cat <<EOF
#!$PYTHON -I
# gpu_preflight launcher: runs the installed module from its bytecode cache
import sys
sys.path.insert(0, "$LIB")
import gpu_preflight
sys.exit(gpu_preflight.main(started=gpu_preflight.process_started()))
EOF
}

install_config() {
    if [ -e "$CONFIG" ] || [ -L "$CONFIG" ]; then
        say "kept existing config: $CONFIG"
        return 0
    fi
    check_writable "$CONFDIR"
    ensure_dir "$CONFDIR"
    put "$CONFIG" 0644 "$(example_config)"
    done_msg install "$CONFIG (example, all commented out)"
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

# Run the installed command once, but only when it sits at its final path.
smoke_test() {
    if [ -n "$DESTDIR" ]; then
        return 0
    fi
    show "$(quote "$TARGET") --version"
    if [ "$DRY_RUN" = 1 ]; then
        return 0
    fi
    if ! _st_out=$("$TARGET" --version </dev/null 2>&1); then
        err "$TARGET was installed but '$TARGET --version' failed:" "$_st_out"
    fi
    say "$_st_out"
}

uninstall() {
    _un_found=0
    for _un_file in "$TARGET" "$MODULE" "$CACHEDIR"/gpu_preflight.*.pyc; do
        if [ -e "$_un_file" ] || [ -L "$_un_file" ]; then
            _un_found=1
            check_writable "${_un_file%/*}"
            run rm -f "$_un_file"
            done_msg remove "$_un_file"
        fi
    done
    _un_cache= # an empty pattern matches no name
    if [ -d "$CACHEDIR" ] && empty_after "$CACHEDIR" 'gpu_preflight.*.pyc'; then
        run rmdir "$CACHEDIR"
        _un_cache=__pycache__
    fi
    if [ -d "$LIBDIR" ] && empty_after "$LIBDIR" gpu_preflight.py "$_un_cache"; then
        run rmdir "$LIBDIR"
    fi
    if [ "$_un_found" = 0 ]; then
        say "not installed: $TARGET"
    fi
    if [ "$NO_CONFIG" = 0 ] && { [ -e "$CONFIG" ] || [ -L "$CONFIG" ]; }; then
        say "kept config: $CONFIG (remove it by hand if it is no longer wanted)"
    fi
}

# ---- Helpers ----------------------------------------------------------------

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

# warn MESSAGE: print "install.sh: warning: MESSAGE" to stderr (even under
# --quiet): something the user must know, though the install goes on.
warn() {
    printf 'install.sh: warning: %s\n' "$1" >&2
}

# usage_err MESSAGE: a usage error; message and usage on stderr, exit 2.
usage_err() {
    printf 'install.sh: %s\n' "$1" >&2
    usage >&2
    exit 2
}

need_cmd() {
    if ! command -v "$1" >/dev/null 2>&1; then
        err "need '$1' (command not found)"
    fi
}

# show TEXT: under --verbose or --dry-run, print TEXT on stderr, each line as
# "+ line": the commands that change something. Under --dry-run they are the
# point, so even --quiet prints them; with "+ " cut they replay as a script.
show() {
    if [ "$DRY_RUN" = 1 ] || [ "$VERBOSE" = 1 ]; then
        printf '%s\n' "$1" | sed 's/^/+ /' >&2
    fi
}

# run CMD ARG...: show the command, then run it (unless --dry-run); die if
# it fails.
run() {
    _run_line=
    for _run_arg in "$@"; do
        _run_line="$_run_line${_run_line:+ }$(quote "$_run_arg")"
    done
    show "$_run_line"
    if [ "$DRY_RUN" = 0 ] && ! "$@"; then
        err "command failed: $*"
    fi
}

# put FILE MODE TEXT: write TEXT (shown as a here-document) as FILE with
# MODE, atomically: written to a temporary name beside FILE, then renamed
# over it.
put() {
    TMP="${1%/*}/.${1##*/}.tmp.$$"
    show "cat > $(quote "$TMP") <<'EOF'
$3
EOF"
    if [ "$DRY_RUN" = 0 ] && ! printf '%s\n' "$3" >"$TMP"; then
        err "cannot write $TMP"
    fi
    run chmod "$2" "$TMP"
    run mv -f "$TMP" "$1"
    TMP=
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
    printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"
}

ensure_dir() {
    if [ ! -d "$1" ]; then
        run install -d -m 0755 "$1"
    fi
}

# own_dir DIR: make DIR a directory of this user, mode 0755 (2755 is fine).
own_dir() {
    if [ ! -d "$1" ]; then
        run install -d -m 0755 "$1"
    elif [ ! -O "$1" ]; then
        err "$1 is owned by another user" \
            "  Remove it (or chown it to this user), then run install.sh again."
    elif [ "$(file_mode "$1")" != drwxr-xr-x ] && [ "$(file_mode "$1")" != drwxr-sr-x ]; then
        run chmod 0755 "$1"
    fi
}

# own_file FILE MODE: FILE is a regular file of this user, not a link, with
# permissions MODE as ls -l shows them: one install.sh may leave as it is.
own_file() {
    [ -f "$1" ] && [ ! -L "$1" ] && [ -O "$1" ] && [ "$(file_mode "$1")" = "$2" ]
}

# file_mode FILE: its permission string as ls -ldL shows it (-rw-r--r--).
file_mode() {
    _fm_line=$(ls -ldL "$1")
    printf '%.10s' "$_fm_line" # without the "." or "+" of an SELinux label or ACL
}

# install_word FILE: "install" for a new file, "update" for a replaced one.
install_word() {
    if [ -e "$1" ] || [ -L "$1" ]; then
        printf update
    else
        printf install
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
        esac
    fi
}

# empty_after DIR PATTERN...: true when every entry of DIR matches a PATTERN,
# so that DIR is empty once those are removed (and rmdir may follow).
empty_after() {
    _ea_dir=$1
    shift
    for _ea_path in "$_ea_dir"/* "$_ea_dir"/.[!.]* "$_ea_dir"/..?*; do
        if [ -e "$_ea_path" ] || [ -L "$_ea_path" ]; then
            _ea_ok=0
            for _ea_pattern in "$@"; do
                # shellcheck disable=SC2254 # a pattern, on purpose
                case ${_ea_path##*/} in $_ea_pattern) _ea_ok=1 ;; esac
            done
            if [ "$_ea_ok" = 0 ]; then
                return 1
            fi
        fi
    done
}

# check_writable DIR: fail early, with a hint, if DIR (or the nearest
# existing parent that would hold it) is not writable.
check_writable() {
    _cw_dir=$1
    while [ ! -d "$_cw_dir" ]; do
        case $_cw_dir in
            */*) _cw_dir=${_cw_dir%/*} ;;
            *) _cw_dir=. ;; # a relative DESTDIR: below the working directory
        esac
        _cw_dir=${_cw_dir:-/}
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

# check_trusted PATH WHAT: fail unless PATH (or the part of it that exists)
# and every directory above it are owned by root and writable by no one else;
# a sticky directory such as /tmp is fine above an entry that passes (the rule
# of gpu_preflight's untrusted(), OpenSSH's StrictModes). The directory a
# link leads to is checked too.
check_trusted() {
    _tr_here=$1
    while [ ! -e "$_tr_here" ] && [ ! -L "$_tr_here" ]; do
        _tr_here=${_tr_here%/*}
        _tr_here=${_tr_here:-/}
    done
    _tr_dir=$_tr_here
    while :; do
        read -r _tr_mode _ _tr_uid _ <<EOF
$(ls -ldn "$_tr_here")
EOF
        case $_tr_mode in
            l*) _tr_mode="link" ;; # its owner counts, and where it leads
            d????????[tT]*) [ "$_tr_here" = "$1" ] || _tr_mode="sticky" ;;
        esac
        if [ "$_tr_uid" != 0 ]; then
            untrusted "$_tr_here is owned by uid $_tr_uid, not root" "chown root $_tr_here" "$2"
        fi
        case $_tr_mode in
            ?????w* | ????????w*)
                untrusted "$_tr_here is writable by group or others" "chmod go-w $_tr_here" "$2"
                ;;
        esac
        if [ "$_tr_here" = / ]; then
            break
        fi
        _tr_here=${_tr_here%/*}
        _tr_here=${_tr_here:-/}
    done
    if [ ! -d "$_tr_dir" ]; then
        _tr_dir=${_tr_dir%/*}
    fi
    _tr_real=$(cd -P "${_tr_dir:-/}" && pwd -P)
    if [ "$_tr_real" != "${_tr_dir:-/}" ]; then
        check_trusted "$_tr_real" "$2"
    fi
}

# untrusted WHY FIX WHAT: refuse a root install that another user could change.
untrusted() {
    err "$1: another user could change what root runs ($3)" \
        "  Fix: $2, or choose another place (--prefix DIR, --python PATH)."
}

# Remove the temporary file or directory an interrupted or failed run left.
cleanup() {
    if [ "$DRY_RUN" = 0 ] && [ -n "${TMP:-}" ] && [ -e "$TMP" ]; then
        rm -rf "$TMP"
    fi
}

# main runs on the last line, so a truncated download of this file runs nothing.
main "$@"
