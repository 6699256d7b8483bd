# Read a Debian suite newer than the machine's own through a PRIVATE apt state (its own sources
# list, lists, status and archives under a cache folder), never changing the system's sources.
# Sourced by integration/guest/fetch-kernel.sh and integration/cri/fetch-containerd.sh.
#
#   CACHE=<folder> SUITE=<suite>; . scripts/private-apt.sh   # needs log() and die()
#   then: apt-get "${APT_OPTS[@]}" download ..., apt-cache "${APT_OPTS[@]}" show ...
#
# Env: RDMA_NETNS_ALLOW_UNSIGNED=1 reads the suite unverified as a last resort.

# Same mirror host as the system uses (first URIs: of the debian.sources file,
# or the first deb line of sources.list), so proxies/mirror policy still apply.
MIRROR=""
if [ -r /etc/apt/sources.list.d/debian.sources ]; then
    MIRROR=$(awk 'tolower($1)=="uris:" {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
fi
if [ -z "$MIRROR" ] && [ -r /etc/apt/sources.list ]; then
    MIRROR=$(awk '$1=="deb" { for (i=2;i<=NF;i++) if ($i !~ /^\[/ && $i !~ /\]$/) {print $i; exit} }' /etc/apt/sources.list)
fi
[ -n "$MIRROR" ] || die "cannot find the Debian mirror in the system's apt sources"
MIRROR=${MIRROR%/}

APTDIR=$CACHE/apt
mkdir -p "$APTDIR/etc" "$APTDIR/state/lists/partial" "$APTDIR/cache/archives/partial"
touch "$APTDIR/state/status"   # empty dpkg status: nothing counts as installed
APT_OPTS=(
    -o "Dir::Etc::SourceList=$APTDIR/etc/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::Etc::Preferences=/dev/null"
    -o "Dir::Etc::PreferencesParts=/dev/null"
    -o "Dir::State=$APTDIR/state"
    -o "Dir::State::Lists=$APTDIR/state/lists"
    -o "Dir::State::status=$APTDIR/state/status"
    -o "Dir::Cache=$APTDIR/cache"
    -o "Dir::Cache::archives=$APTDIR/cache/archives"
    -o "APT::Architecture=amd64"
    -o "APT::Architectures=amd64"
    # the private state is ours alone (guarded by flock above); the system's
    # apt lock is not needed and must not block a concurrent system apt-get.
    -o "Debug::NoLocking=1"
)
papt_update() {  # $1 = the [options] of the deb line
    printf 'deb [%s] %s %s main\n' "$1" "$MIRROR" "$SUITE" > "$APTDIR/etc/sources.list"
    rm -f "$APTDIR/state/lists/"*_dists_* 2>/dev/null || true
    # apt-get update exits non-zero when the Release signature cannot be verified
    apt-get "${APT_OPTS[@]}" update -qq >"$APTDIR/update.log" 2>&1 &&
        ! grep -qE '^(W|E): .*(NO_PUBKEY|not signed|EXPKEYSIG|KEYEXPIRED|BADSIG)' "$APTDIR/update.log"
}

# Keyring: the suite is signed with the trixie archive keys. Debian 12's
# debian-archive-keyring (2023.3+deb12u2 and later) already contains them.
# If it does not (older point release, or the suite moved on to newer keys),
# take the newest debian-archive-keyring .deb the SYSTEM's (verified) sources
# offer, unpack it with dpkg -x into a private folder and use that keyring.
# Unverified reading ([trusted=yes]) is only used when explicitly allowed.
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
if ! papt_update "signed-by=$KEYRING"; then
    log "system keyring cannot verify $SUITE; trying a newer debian-archive-keyring"
    KR=$CACHE/keyring
    rm -rf "$KR" && mkdir -p "$KR/x"
    chown _apt "$KR" 2>/dev/null || true
    ( cd "$KR" && apt-get download -qq debian-archive-keyring >&2 ) ||
        { apt-get update -qq && ( cd "$KR" && apt-get download -qq debian-archive-keyring >&2 ); } || true
    for deb in "$KR"/debian-archive-keyring_*.deb; do
        if [ -e "$deb" ]; then dpkg -x "$deb" "$KR/x"; fi
    done
    KEYRING=$KR/x/usr/share/keyrings/debian-archive-keyring.gpg
    if [ ! -s "$KEYRING" ] || ! papt_update "signed-by=$KEYRING"; then
        cat "$APTDIR/update.log" >&2
        if [ "${RDMA_NETNS_ALLOW_UNSIGNED:-0}" = 1 ]; then
            # Last resort, opt-in only: test-only kernel for a throwaway VM; the
            # packages are still checked against the (unverified) index hashes.
            log "WARNING: reading $SUITE UNVERIFIED ([trusted=yes]) as RDMA_NETNS_ALLOW_UNSIGNED=1"
            papt_update "trusted=yes" || { cat "$APTDIR/update.log" >&2; die "apt-get update of $SUITE failed"; }
        else
            die "cannot verify $SUITE with any keyring (set RDMA_NETNS_ALLOW_UNSIGNED=1 to read it unverified)"
        fi
    fi
fi

