"""The sandbox runtime: an E2B-compatible server (``python -m envs.sandbox serve``) and rlk3's SDK client.

Agentic rollouts run their commands in sandboxes. AgentENV, the runtime behind K3's RL, runs Firecracker
microVMs behind E2B's HTTP API; these machines have no usable KVM, so rlk3's default backend is a *process*
sandbox with the same lifecycle (create, exec, files, pause, resume, snapshot, fork, kill) and API.
rlk3 itself talks to sandboxes only through the public ``e2b`` SDK (:mod:`envs.sandbox.client`), so pointing
two URLs at E2B's cloud or an AgentENV fleet swaps the backend without touching rollout code.

What the bwrap backend protects against
---------------------------------------
Each sandbox runs in its own PID, mount, network (loopback only), IPC, UTS and cgroup namespaces, inside a
user namespace whose root is the unprivileged host uid 100000 (ids 0..65535 map to 100000..165535). It sees
the host's ``/usr`` read-only, its own copy of a curated ``/etc``, and its own layered disk; cgroups cap its
CPU, memory and process count; a btrfs qgroup caps its disk. tests/envs/test_sandbox_attacks.py
shows that, from inside, these attempts fail and leave the host unaffected: network egress (to a listener
on the host's loopback), reading or writing host files, the server's state or another sandbox's layers,
writing host sysctls, escaping through ``../``, absolute paths or symlinks given to the files API, fork and
memory bombs, filling the disk, seeing or ptracing host processes, impersonating the agent on its socket,
and processes outliving ``kill`` (cgroup.kill reaches every process, frozen or daemonised).

What it does NOT protect against
--------------------------------
It shares the host kernel. A kernel bug reachable from an unprivileged user namespace (and user namespaces
expose a lot of kernel surface: mounts, netfilter, overlayfs, ...) can become a host compromise; there is no
seccomp filter beyond bubblewrap's defaults. Sandboxes booted by one server share one user namespace and one
host uid (CRIU-restored ones get a namespace of their own but the same id range), so a kernel-level escape
from one reaches the others. Side channels (CPU caches, timing, /proc/meminfo-style global counters) are
open. Denial of service is bounded per sandbox but not eliminated: I/O bandwidth is not limited, and the
agent socket is reachable from inside (connections from anything but the agent are refused). For untrusted
code that must not share a kernel, use the ``gvisor`` backend (below), or E2B's cloud or AgentENV's microVMs
by URL — the same SDK calls work against them.

The gvisor backend
------------------
``serve --backend gvisor`` (or one create request's metadata ``{"rlk3.backend": "gvisor"}``) runs a sandbox
on gVisor's user-space kernel (runsc) over the same disk, cgroups and agent (:mod:`envs.sandbox.gvisor`): the
sandbox's system calls reach gVisor's Sentry, not the host kernel, so a host-kernel bug is no longer one
system call away. It does not remove the side channels, it shares the host uid range with bwrap sandboxes,
a memory limit it exceeds may kill the whole sandbox, and process creation is many times slower
(docs/sandbox.md lists what it does and does not do on this machine).
"""

from .client import ExecResult, SandboxClient, SandboxSettings

__all__ = ["ExecResult", "SandboxClient", "SandboxSettings"]
