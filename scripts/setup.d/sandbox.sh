#!/usr/bin/env bash
# System parts of the sandbox runtime (envs/sandbox), idempotent:
#   bubblewrap (namespaces), btrfs-progs (the quota'd layer disk), iptables (CRIU restores network namespaces
#   with iptables-restore), python3-venv + python3-pytest (the `python` template), node + npm (the `node`
#   template, only if the host has no node yet), runsc from bookworm-backports (the gVisor backend), and
#   CRIU 4.1.1 built once from the upstream tarball Debian trixie ships: bookworm's CRIU 3.17 fails on this
#   kernel's vDSO layout. Builds go to .cache/ (gitignored); the system apt configuration is never changed.
# inputs: envs/sandbox/restore_hook.c
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export DEBIAN_FRONTEND=noninteractive

PKGS=(bubblewrap btrfs-progs iptables iproute2 patch util-linux python3 python3-venv python3-pytest
      build-essential pkg-config libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev protobuf-compiler
      python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev uuid-dev libgnutls28-dev
      libnftables-dev libaio-dev)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
command -v node >/dev/null || missing+=(nodejs npm)
if ((${#missing[@]})); then
  echo "sandbox: apt-get install ${missing[*]}"
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

# a private apt state, so the host's sources stay as they are
private_apt() {  # $1 = name, $2 = sources text; prints the apt options to use
  local dir="$ROOT/.cache/apt-$1"
  mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
  printf '%s\n' "$2" > "$dir/sources.list"
  echo "-o Dir::Etc::SourceList=$dir/sources.list -o Dir::Etc::SourceParts=/dev/null" \
       "-o Dir::State::Lists=$dir/lists -o Dir::Cache=$dir/cache"
}

# ---- CRIU 4.1.1
CRIU_SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
# CRIU probes the kernel's features on every run (~15-40 ms here) unless it may cache them in a file on a
# tmpfs under RUNDIR; /run is not a tmpfs on these machines, /dev/shm is. The server creates this directory
# (root, 0700) at start: envs/sandbox/bwrap.py CRIU_KDAT_DIR must name the same path.
CRIU_RUNDIR=/dev/shm/rlk3-criu
# Linux 6.16 made SO_PASSCRED/SO_PASSSEC unix/netlink-only: CRIU 4.1.1 then fails to dump any TCP or UDP
# socket ("Can't get 1:16 opt: Operation not supported", criu issue #2718). This patch skips the two options
# where the kernel says they do not exist (there is nothing to restore for them).
CRIU_PATCH=$(cat <<'PATCH'
--- a/criu/sockets.c
+++ b/criu/sockets.c
@@ -642,6 +642,7 @@
 	int ret = 0, val;
 	struct timeval tv;
 	struct linger so_linger = { 0, 0 };
+	socklen_t aux;
 
 	ret |= dump_opt(sk, SOL_SOCKET, SO_SNDBUF, &soe->so_sndbuf);
 	ret |= dump_opt(sk, SOL_SOCKET, SO_RCVBUF, &soe->so_rcvbuf);
@@ -676,13 +677,27 @@
 	soe->so_reuseport = val ? true : false;
 	soe->has_so_reuseport = true;
 
-	ret |= dump_opt(sk, SOL_SOCKET, SO_PASSCRED, &val);
-	soe->has_so_passcred = true;
-	soe->so_passcred = val ? true : false;
-
-	ret |= dump_opt(sk, SOL_SOCKET, SO_PASSSEC, &val);
-	soe->has_so_passsec = true;
-	soe->so_passsec = val ? true : false;
+	/*
+	 * Since Linux 6.16 only unix, netlink and bluetooth sockets have these
+	 * options; other sockets answer EOPNOTSUPP and have nothing to save.
+	 */
+	aux = sizeof(val);
+	if (getsockopt(sk, SOL_SOCKET, SO_PASSCRED, &val, &aux) == 0) {
+		soe->has_so_passcred = true;
+		soe->so_passcred = val ? true : false;
+	} else if (errno != EOPNOTSUPP) {
+		pr_perror("Can't get SO_PASSCRED");
+		ret = -1;
+	}
+
+	aux = sizeof(val);
+	if (getsockopt(sk, SOL_SOCKET, SO_PASSSEC, &val, &aux) == 0) {
+		soe->has_so_passsec = true;
+		soe->so_passsec = val ? true : false;
+	} else if (errno != EOPNOTSUPP) {
+		pr_perror("Can't get SO_PASSSEC");
+		ret = -1;
+	}
 
 	ret |= dump_opt(sk, SOL_SOCKET, SO_DONTROUTE, &val);
 	soe->has_so_dontroute = true;
PATCH
)
criu_build_id=$(printf '%s\n' 4.1.1 "$CRIU_RUNDIR" "$CRIU_PATCH" | sha1sum | cut -c1-12)
if ! [ -x .cache/criu/criu ] || [ "$(cat .cache/criu/build-id 2>/dev/null)" != "$criu_build_id" ]; then
  opts=$(private_apt trixie-src "deb-src http://deb.debian.org/debian trixie main")
  # shellcheck disable=SC2086
  apt-get $opts update -q >/dev/null
  work=$(mktemp -d)
  # the .dsc may be gone from the pool while the upstream tarball stays; only the tarball is needed
  # shellcheck disable=SC2086
  (cd "$work" && apt-get $opts source --download-only criu=4.1.1-1 >/dev/null 2>&1 || true)
  tarball="$work/criu_4.1.1.orig.tar.xz"
  [ -f "$tarball" ] || { echo "sandbox: could not download criu_4.1.1.orig.tar.xz from Debian trixie" >&2; exit 1; }
  echo "$CRIU_SHA256  $tarball" | sha256sum -c --quiet
  tar -C "$work" -xf "$tarball"
  printf '%s\n' "$CRIU_PATCH" | patch -s -d "$work/criu-4.1.1" -p1
  echo "sandbox: building CRIU 4.1.1 (about 30-50 s)"
  make -C "$work/criu-4.1.1" -j"$(nproc)" criu RUNDIR="$CRIU_RUNDIR" >"$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log"; exit 1; }
  mkdir -p .cache/criu
  install -m 755 "$work/criu-4.1.1/criu/criu" .cache/criu/criu
  echo "$criu_build_id" > .cache/criu/build-id
  rm -rf "$work"
fi
# CRIU's restore hook (envs/sandbox/restore_hook.c), static so it runs in any mount namespace; rebuilt when the
# source changes
hook_id=$(sha1sum envs/sandbox/restore_hook.c | cut -c1-12)
if ! [ -x .cache/criu/restore-hook ] || [ "$(cat .cache/criu/restore-hook.id 2>/dev/null)" != "$hook_id" ]; then
  cc -O2 -static -Wall -Werror -o .cache/criu/restore-hook.new envs/sandbox/restore_hook.c
  mv .cache/criu/restore-hook.new .cache/criu/restore-hook
  echo "$hook_id" > .cache/criu/restore-hook.id
fi
.cache/criu/criu check >/dev/null 2>&1 || echo "sandbox: warning: criu check did not pass on this kernel" >&2

# ---- runsc (gVisor) from bookworm-backports, unpacked into .cache/runsc (not installed system-wide)
if ! [ -x .cache/runsc/usr/bin/runsc ]; then
  opts=$(private_apt bookworm-backports "deb http://deb.debian.org/debian bookworm-backports main")
  # shellcheck disable=SC2086
  apt-get $opts update -q >/dev/null
  work=$(mktemp -d)
  # shellcheck disable=SC2086
  (cd "$work" && apt-get $opts download runsc >/dev/null 2>&1)
  mkdir -p .cache/runsc
  dpkg -x "$work"/runsc_*.deb .cache/runsc
  rm -rf "$work"
fi
# ---- the node template's offline npm cache: every package of envs/sandbox/node-web (a Vite + React app),
# tarballs and registry metadata, fetched here (sandboxes have no network) and copied into the template
WEB=envs/sandbox/node-web
web_stamp=.cache/npm-web/done-$(cat "$WEB/package.json" "$WEB/package-lock.json" | sha1sum | cut -c1-12)
if ! [ -f "$web_stamp" ]; then
  rm -rf .cache/npm-web
  mkdir -p .cache/npm-web/cache
  work=$(mktemp -d)
  cp "$WEB/package.json" "$WEB/package-lock.json" "$work"/
  # the lockfile's tarballs (only this platform's optional binaries: esbuild's and rollup's linux-x64)
  (cd "$work" && npm ci --ignore-scripts --no-audit --no-fund --cache "$ROOT/.cache/npm-web/cache" >/dev/null)
  # and each installed package's metadata, so `npm install <name>@<version> --offline` resolves by name
  specs=$(cd "$work" && node -e '
    const l = require("./package-lock.json"), fs = require("fs");
    for (const [p, v] of Object.entries(l.packages))
      if (p && fs.existsSync(p)) console.log(`${v.name || p.split("node_modules/").pop()}@${v.version}`);')
  # shellcheck disable=SC2086
  npm cache add $specs --cache "$ROOT/.cache/npm-web/cache" >/dev/null
  rm -rf "$work"
  touch "$web_stamp"
fi

echo "sandbox: bwrap $(bwrap --version | cut -d' ' -f2), $(.cache/criu/criu --version | head -1), runsc $(.cache/runsc/usr/bin/runsc --version 2>/dev/null | head -1 | awk '{print $3}')"
