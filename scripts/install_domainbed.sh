#!/usr/bin/env bash
# Put DomainBed beside the environment and make `import domainbed` work inside it
# (a .pth file), so DOMAINBED_ROOT becomes optional. Run by
# `bash scripts/setup_env.sh --with-domainbed[=SOURCE]`; usable alone on any venv:
#   VENV=.venv bash scripts/install_domainbed.sh                  # git clone upstream, tested commit
#   VENV=.venv bash scripts/install_domainbed.sh /path/to/DomainBed[@COMMIT]
#   VENV=.venv bash scripts/install_domainbed.sh DomainBed.tar.gz[@COMMIT]
# A local SOURCE is a checkout or a tarball of one; @COMMIT is the commit it claims
# (read from its .git when it has one). The claim is checked where it can be: against
# the checkout's HEAD, or, for a copy without git history that claims the tested
# commit, against the tested commit's Python files (their digest, below); a claim that
# fails is refused, one that cannot be checked is said to be unchecked. It is copied, never linked, to
# $VENV/src/DomainBed (pip's place for source checkouts; DOMAINBED_DIR overrides).
# DomainBed's own Python dependencies (wilds, timm) come with this package's
# [domainbed] extra. When the clone fails, one line says what else to do and the
# environment stays usable (exit 0).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
py="$VENV/bin/python"
TESTED=b93c22a1cfc3b2428398272c1a116c8de1f4139e  # domainbed_vasso._locate.TESTED_COMMIT
# sha256 over domainbed/**/*.py at $TESTED (path, NUL, sha256 of the bytes; in os.walk's
# sorted order, __pycache__ left out): see py_digest
TESTED_DIGEST=c897285337064cbfdbfe83ba4ce14188fa7d8d81c390207bd6c5ae21aeb4e6fd
URL=${DOMAINBED_GIT_URL:-https://github.com/facebookresearch/DomainBed}
DEST=${DOMAINBED_DIR:-$VENV/src/DomainBed}
SOURCE=${1:-}

[ -x "$py" ] || { echo "install_domainbed.sh: no environment at $VENV (run scripts/setup_env.sh first)" >&2; exit 2; }
short() { printf '%s' "${1:0:7}"; }
py_digest() {  # the digest of a DomainBed copy's Python files, as TESTED_DIGEST was made
    "$py" - "$1" <<'PY'
import hashlib, os, sys
root = os.path.join(sys.argv[1], "domainbed")
h = hashlib.sha256()
for folder, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__")
    for name in sorted(files):
        if name.endswith(".py"):
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                h.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0"
                         + hashlib.sha256(f.read()).digest())
print(h.hexdigest())
PY
}

claimed=""
case "$SOURCE" in
    "") ;;
    *@*) claimed=${SOURCE##*@}; SOURCE=${SOURCE%@*} ;;
esac

tmp=$(mktemp -d "${TMPDIR:-/tmp}/domainbed-src.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
if [ -z "$SOURCE" ]; then
    if [ -f "$DEST/domainbed/__init__.py" ] && [ "$(cat "$DEST/COMMIT" 2>/dev/null)" = "$TESTED" ]; then
        echo "DomainBed $(short "$TESTED") already at $DEST"
    elif GIT_TERMINAL_PROMPT=0 timeout 300 git clone --quiet "$URL" "$tmp/DomainBed" >/dev/null 2>&1 \
            && git -C "$tmp/DomainBed" -c advice.detachedHead=false checkout --quiet "$TESTED" >/dev/null 2>&1; then
        claimed=$TESTED
        verified=git
    else
        echo "DomainBed: could not clone $URL at $(short "$TESTED"); the environment is ready without it." \
             "Give a local copy with --with-domainbed=/path/to/DomainBed[@COMMIT] (a checkout or tarball)," \
             "or set DOMAINBED_ROOT=/path/to/DomainBed when running." >&2
        exit 0
    fi
elif [ -d "$SOURCE" ]; then
    [ -f "$SOURCE/domainbed/__init__.py" ] || {
        echo "install_domainbed.sh: $SOURCE has no domainbed/__init__.py: give the DomainBed checkout's top folder" >&2; exit 2; }
    if head=$(git -C "$SOURCE" rev-parse --verify -q HEAD 2>/dev/null) \
            && [ "$(git -C "$SOURCE" rev-parse --show-toplevel 2>/dev/null)" = "$(cd "$SOURCE" && pwd -P)" ]; then
        if [ -n "$claimed" ] && [ "$(git -C "$SOURCE" rev-parse --verify -q "$claimed^{commit}" 2>/dev/null)" != "$head" ]; then
            echo "install_domainbed.sh: $SOURCE is a checkout at $(short "$head"), not at $claimed:" \
                 "check out $claimed there (git -C $SOURCE checkout $claimed), or give $SOURCE without @$claimed" >&2
            exit 2
        fi
        claimed=$head
        verified=git
    fi
    cp -R "$SOURCE" "$tmp/DomainBed"
elif [ -f "$SOURCE" ]; then
    mkdir "$tmp/unpack"
    tar -xf "$SOURCE" -C "$tmp/unpack" || { echo "install_domainbed.sh: cannot unpack $SOURCE (expected a tarball)" >&2; exit 2; }
    top=$(dirname "$(find "$tmp/unpack" -path '*/domainbed/__init__.py' | awk '{print length, $0}' | sort -n | head -1 | cut -d' ' -f2-)")
    top=$(dirname "$top")
    [ -f "$top/domainbed/__init__.py" ] || { echo "install_domainbed.sh: no domainbed/__init__.py in $SOURCE" >&2; exit 2; }
    if [ -z "$claimed" ]; then  # GitHub's archives are named DomainBed-<commit>
        case "$(basename "$top")" in DomainBed-[0-9a-f]*) claimed=${top##*/DomainBed-} ;; esac
    fi
    mv "$top" "$tmp/DomainBed"
else
    echo "install_domainbed.sh: $SOURCE: no such folder or tarball" >&2; exit 2
fi

# a copy without git history: its claim to be the tested commit is checked by content
if [ -d "$tmp/DomainBed" ] && [ -n "$claimed" ] && [ -z "${verified:-}" ]; then
    case "$TESTED" in
        "$claimed"*)
            if [ ${#claimed} -ge 7 ] && [ "$(py_digest "$tmp/DomainBed")" = "$TESTED_DIGEST" ]; then
                verified=content
            elif [ ${#claimed} -ge 7 ]; then
                echo "install_domainbed.sh: ${SOURCE} claims commit $claimed, but its domainbed/*.py differ from" \
                     "DomainBed $(short "$TESTED")'s: give an unmodified copy of $(short "$TESTED")" \
                     "(or its git checkout), or give it without @$claimed to install it as of unknown commit" >&2
                exit 2
            fi ;;
    esac
fi

if [ -d "$tmp/DomainBed" ]; then
    copied=1
    chmod -R u+w "$tmp/DomainBed"
    printf '%s\n' "${claimed:-unknown}" > "$tmp/DomainBed/COMMIT"
    rm -rf "$DEST"
    mkdir -p "$(dirname "$DEST")"
    mv "$tmp/DomainBed" "$DEST"
fi
DEST=$(cd "$DEST" && pwd)
commit=$(cat "$DEST/COMMIT")
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf '%s\n' "$DEST" > "$site/domainbed_checkout.pth"
where=$("$py" -c "import os, domainbed; print(os.path.dirname(os.path.dirname(os.path.abspath(domainbed.__file__))))")
[ "$where" = "$DEST" ] || { echo "install_domainbed.sh: $VENV imports domainbed from $where, not $DEST (remove the other copy from its path)" >&2; exit 1; }
case "$TESTED" in
    "$commit"*) [ ${#commit} -ge 7 ] || commit=unknown ;;&
    "$commit"*) echo "DomainBed $(short "$commit") at $DEST, importable in $VENV" ;;
    *) if [ "$commit" != unknown ] && [ -n "${copied:-}" ] && [ -z "${verified:-}" ]; then
           unchecked=" as given, not checked (the copy has no git history to check it against)"
       fi
       echo "DomainBed at $DEST, importable in $VENV; its commit is ${commit}${unchecked:-}," \
            "this project is tested at $(short "$TESTED")" \
            "(give the commit as SOURCE@COMMIT if you know it)" ;;
esac
