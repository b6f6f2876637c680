"""The in-sandbox agent: PID 1 of every bwrap sandbox.

It runs under the system ``/usr/bin/python3 -I -S`` inside the sandbox, so it may import only the standard
library and nothing of rlk3. It owns every process of the sandbox (commands are its children, orphans are
reparented to it), so a CRIU dump of the tree rooted at it captures the whole sandbox: processes, their
pipes and the output not yet delivered.

It talks to the server over one unix socket, ``/run/rlk3/agent.sock``, a directory bind-mounted read-only
from the host and shared by all sandboxes. The server tells agents apart by the peer PID of the connection
(SO_PEERCRED), never by anything the agent says, so a process inside a sandbox that connects too is refused.

Before a checkpoint the server sends ``detach``: the agent closes the socket (CRIU cannot dump a socket
whose peer is outside) and holds still until SIGUSR1, which the server sends after the restore (or after a
failed dump). If the connection drops without ``detach`` (server restart) the agent polls to reconnect.

Wire format, both ways: ``>II`` (header length, body length), a JSON header, then raw body bytes.
"""

import contextlib
import errno
import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import time

SOCK = "/run/rlk3/agent.sock"
HDR = struct.Struct(">II")
OUT_CAP = 4 << 20  # stop reading command pipes while this much output waits for the server (backpressure)
CHUNK = 1 << 20
EXIT_GRACE = 0.2  # seconds to wait for pipe EOF after a command exits (grandchildren may hold the pipe)
POLL = 0.2  # reconnect poll interval after an unexpected disconnect
MAXFD = 1024

USERS = {"root": (0, 0, "/root"), "user": (1000, 1000, "/home/user")}


class Child:
    __slots__ = ("args", "cmd", "cwd", "envs", "err", "exited_at", "out", "pid", "status", "stdin", "tag")

    def __init__(self, pid, msg, stdin, out, err):
        self.pid = pid
        self.tag = msg.get("tag")
        self.cmd = msg["cmd"]
        self.args = msg.get("args", [])
        self.envs = msg.get("envs", {})
        self.cwd = msg.get("cwd", "")
        self.stdin = stdin
        self.out = out
        self.err = err
        self.status = None
        self.exited_at = None


class Agent:
    def __init__(self, sid):
        self.sid = sid
        self.conn = None
        self.mode = "seeking"  # connected | held (after detach, until SIGUSR1) | seeking (poll)
        self.rbuf = bytearray()
        self.wbuf = bytearray()
        self.children = {}
        self.fds = {}  # pipe fd -> (pid, "stdout" | "stderr")
        self.base_env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
        }
        self.reads = []  # pending chunked file reads: [rid, fd]
        self.writes = {}  # rid -> (fd, path, uid, gid)
        self.watches = {}  # wid -> Watch
        self.inotify = None
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(self.wake_w)
        for sig in (signal.SIGCHLD, signal.SIGUSR1):
            signal.signal(sig, lambda *_: None)

    # ---------------------------------------------------------------- wire
    def send(self, hdr, body=b""):
        h = json.dumps(hdr, separators=(",", ":")).encode()
        self.wbuf += HDR.pack(len(h), len(body)) + h + body

    def frames(self):
        while len(self.rbuf) >= HDR.size:
            hl, bl = HDR.unpack_from(self.rbuf)
            if len(self.rbuf) < HDR.size + hl + bl:
                return
            h = json.loads(self.rbuf[HDR.size : HDR.size + hl])
            body = bytes(self.rbuf[HDR.size + hl : HDR.size + hl + bl])
            del self.rbuf[: HDR.size + hl + bl]
            yield h, body

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(SOCK)
        except OSError:
            s.close()
            return
        s.setblocking(False)
        self.conn = s
        self.mode = "connected"
        self.rbuf.clear()
        # the server learns which sandbox this is from the peer PID; the hello says what is still running
        hello = {"ev": "hello", "sid": self.sid, "procs": [self.info(c) for c in self.children.values()]}
        self.wbuf[:0] = self._frame(hello)

    def _frame(self, hdr, body=b""):
        h = json.dumps(hdr, separators=(",", ":")).encode()
        return HDR.pack(len(h), len(body)) + h + body

    def drop(self, hold):
        if self.conn is not None:
            self.conn.close()
        self.conn = None
        self.mode = "held" if hold else "seeking"
        self.rbuf.clear()
        # a reply half-written to a dead connection is useless; keep only whole event frames queued after it
        if hold:
            return
        self.wbuf.clear()

    # ---------------------------------------------------------------- processes
    def info(self, c):
        return {"pid": c.pid, "tag": c.tag, "cmd": c.cmd, "args": c.args, "envs": c.envs, "cwd": c.cwd}

    def start(self, rid, m):
        user = USERS.get(m.get("user") or "user", USERS["user"])
        cwd = m.get("cwd") or user[2]
        env = dict(self.base_env)
        env.update({"HOME": user[2], "USER": m.get("user") or "user", "PWD": cwd})
        env.update(m.get("envs") or {})
        fds = []
        try:
            if m.get("stdin"):
                in_r, in_w = os.pipe()
            else:
                in_r, in_w = os.open("/dev/null", os.O_RDONLY), None
            fds += [in_r] + ([in_w] if in_w is not None else [])
            out_r, out_w = os.pipe()
            fds += [out_r, out_w]
            err_r, err_w = os.pipe()
            fds += [err_r, err_w]
            chk_r, chk_w = os.pipe2(os.O_CLOEXEC)
            fds += [chk_r, chk_w]
            pid = os.fork()
        except OSError as e:  # a fork bomb at the process limit, or out of fds: refuse this one, live on
            for fd in fds:
                os.close(fd)
            self.send({"ev": "error", "rid": rid, "code": "resource_exhausted", "message": f"cannot start: {e}"})
            return
        if pid == 0:  # child: never returns
            try:
                os.setsid()
                os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                os.dup2(chk_w, 3)
                os.set_inheritable(3, False)
                os.closerange(4, MAXFD)
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGCHLD, signal.SIGUSR1, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                uid, gid, _ = user
                os.setgroups([gid])
                os.setgid(gid)
                os.setuid(uid)
                os.chdir(cwd)
                os.execvpe(m["cmd"], [m["cmd"], *m.get("args", [])], env)
            except BaseException as e:  # report why exec failed through the CLOEXEC pipe
                try:
                    os.write(3, f"{type(e).__name__}: {e}".encode()[:4000])
                finally:
                    os._exit(127)
        for fd in (in_r, out_w, err_w, chk_w):
            os.close(fd)
        why = b""
        while True:
            try:
                part = os.read(chk_r, 4096)
            except InterruptedError:
                continue
            if not part:
                break
            why += part
        os.close(chk_r)
        if why:
            for fd in (out_r, err_r) + ((in_w,) if in_w is not None else ()):
                os.close(fd)
            self.reap()
            self.send(
                {
                    "ev": "error",
                    "rid": rid,
                    "code": "invalid_argument",
                    "message": why.decode(errors="replace"),
                }
            )
            return
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        c = Child(pid, m, in_w, out_r, err_r)
        self.children[pid] = c
        self.fds[out_r] = (pid, "stdout")
        self.fds[err_r] = (pid, "stderr")
        self.send({"ev": "started", "rid": rid, "pid": pid})

    def find(self, m):
        if m.get("pid"):
            return self.children.get(int(m["pid"]))
        tag = m.get("tag")
        return next((c for c in self.children.values() if tag is not None and c.tag == tag), None)

    def pump_child(self, fd):
        pid, stream = self.fds[fd]
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.send({"ev": "out", "pid": pid, "s": stream}, data)
            return
        self.close_pipe(fd)

    def close_pipe(self, fd):
        pid, stream = self.fds.pop(fd)
        os.close(fd)
        c = self.children.get(pid)
        if c is not None:
            setattr(c, "out" if stream == "stdout" else "err", None)
            self.maybe_end(c)

    def maybe_end(self, c, force=False):
        if c.status is None or ((c.out is not None or c.err is not None) and not force):
            return
        for fd in (c.out, c.err):
            if fd is not None:
                self.fds.pop(fd, None)
                os.close(fd)
        if c.stdin is not None:
            os.close(c.stdin)
        del self.children[c.pid]
        st = c.status
        if os.WIFSIGNALED(st):
            sig = os.WTERMSIG(st)
            end = {
                "ev": "exit",
                "pid": c.pid,
                "code": -1,
                "signal": sig,
                "status": f"signal: {signal.Signals(sig).name}",
            }
        else:
            code = os.WEXITSTATUS(st)
            end = {"ev": "exit", "pid": c.pid, "code": code, "signal": 0, "status": f"exit status {code}"}
        self.send(end)

    def reap(self):
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            c = self.children.get(pid)
            if c is not None:  # orphans reparented to us are reaped and forgotten
                c.status = st
                c.exited_at = time.monotonic()
                self.maybe_end(c)

    # ---------------------------------------------------------------- files
    def resolve(self, m):
        user = USERS.get(m.get("user") or "user", USERS["user"])
        path = m.get("path") or ""
        if not path:
            raise ValueError("path is empty")
        if "\0" in path:
            raise ValueError("path contains a NUL byte")
        return os.path.normpath(os.path.join(user[2], path)), user

    def entry(self, path):
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            kind, target = 3, os.readlink(path)
            try:
                real = os.stat(path)
                kind = 2 if stat.S_ISDIR(real.st_mode) else 1
            except OSError:
                pass
        else:
            kind, target = (2 if stat.S_ISDIR(st.st_mode) else 1), None
        return {
            "name": os.path.basename(path) or "/",
            "type": kind,
            "path": path,
            "size": st.st_size,
            "mode": stat.S_IMODE(st.st_mode),
            "permissions": stat.filemode(st.st_mode),
            "owner": self.name_of(st.st_uid),
            "group": self.name_of(st.st_gid),
            "mtime": st.st_mtime,
            "symlink": target,
        }

    def name_of(self, uid):
        return {0: "root", 1000: "user"}.get(uid, str(uid))

    def file_op(self, rid, op, m, body):
        try:
            if op == "wdata":
                fd, _ = self.writes[m["wid"]]
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view) :]
                self.send({"ev": "ok", "rid": rid})
                return
            if op == "wclose":
                fd, p = self.writes.pop(m["wid"])
                os.close(fd)
                self.send({"ev": "ok", "rid": rid, "entry": self.entry(p)})
                return
            path, user = self.resolve(m)
            if op == "stat":
                self.send({"ev": "ok", "rid": rid, "entry": self.entry(path)})
            elif op == "mkdir":
                if os.path.lexists(path):
                    self.send({"ev": "error", "rid": rid, "code": "already_exists", "message": f"{path} exists"})
                    return
                self.makedirs(path, user)
                self.send({"ev": "ok", "rid": rid, "entry": self.entry(path)})
            elif op == "move":
                dst, _ = self.resolve({"path": m.get("dest"), "user": m.get("user")})
                self.makedirs(os.path.dirname(dst), user)
                os.rename(path, dst)
                self.send({"ev": "ok", "rid": rid, "entry": self.entry(dst)})
            elif op == "remove":
                self.remove(path)
                self.send({"ev": "ok", "rid": rid})
            elif op == "list":
                depth = max(1, int(m.get("depth") or 1))
                if not os.path.isdir(path):
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
                self.send({"ev": "ok", "rid": rid, "entries": self.listdir(path, depth)})
            elif op == "read":
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise IsADirectoryError(errno.EISDIR, "is a directory", path)
                os.set_blocking(fd, True)
                self.send({"ev": "ok", "rid": rid, "size": os.fstat(fd).st_size})
                self.reads.append([rid, fd])
            elif op == "wopen":
                self.makedirs(os.path.dirname(path), user)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                if os.fstat(fd).st_uid == 0 and user[0]:
                    os.fchown(fd, user[0], user[1])
                self.writes[rid] = (fd, path)
                self.send({"ev": "ok", "rid": rid})
            else:
                self.send({"ev": "error", "rid": rid, "code": "unimplemented", "message": f"unknown op {op}"})
        except (OSError, ValueError, KeyError) as e:
            self.send({"ev": "error", "rid": rid, "code": self.code(e), "message": str(e)})

    @staticmethod
    def code(e):
        if isinstance(e, FileNotFoundError):
            return "not_found"
        if isinstance(e, FileExistsError):
            return "already_exists"
        if isinstance(e, PermissionError) or getattr(e, "errno", None) == errno.EROFS:
            return "permission_denied"
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return "resource_exhausted"
        return "invalid_argument"

    def makedirs(self, path, user):
        missing = []
        p = path
        while p and not os.path.lexists(p):
            missing.append(p)
            p = os.path.dirname(p)
        for d in reversed(missing):
            os.mkdir(d, 0o755)
            if user[0]:
                os.chown(d, user[0], user[1])

    def remove(self, path):
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return
        for name in os.listdir(path):
            self.remove(os.path.join(path, name))
        os.rmdir(path)

    def listdir(self, path, depth):
        out = []
        for name in sorted(os.listdir(path)):
            p = os.path.join(path, name)
            try:
                e = self.entry(p)
            except OSError:
                continue
            out.append(e)
            if depth > 1 and e["type"] == 2 and e["symlink"] is None:
                out.extend(self.listdir(p, depth - 1))
        return out

    def pump_reads(self):
        while self.reads and len(self.wbuf) < OUT_CAP:
            rid, fd = self.reads[0]
            data = os.read(fd, CHUNK)
            if data:
                self.send({"ev": "chunk", "rid": rid}, data)
                continue
            os.close(fd)
            self.reads.pop(0)
            self.send({"ev": "eof", "rid": rid})

    # ---------------------------------------------------------------- watches (inotify via libc)
    def watch(self, rid, m):
        try:
            path, _ = self.resolve(m)
            if not os.path.isdir(path):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
            if self.inotify is None:
                self.inotify = Inotify()
            wid = m["wid"]
            self.inotify.add(wid, path, bool(m.get("recursive")))
            self.send({"ev": "ok", "rid": rid})
        except (OSError, ValueError, KeyError) as e:
            self.send({"ev": "error", "rid": rid, "code": self.code(e), "message": str(e)})

    def pump_inotify(self):
        for wid, name, kind in self.inotify.read():
            self.send({"ev": "fsev", "wid": wid, "name": name, "type": kind})

    def unwatch_all(self):
        if self.inotify is not None:
            for wid in self.inotify.close():
                self.send({"ev": "unwatched", "wid": wid})
            self.inotify = None

    # ---------------------------------------------------------------- control
    def handle(self, h, body):
        op, rid = h.get("op"), h.get("rid")
        if op == "start":
            self.start(rid, h)
        elif op == "input":
            c = self.find(h)
            if c is None or c.stdin is None:
                self.send({"ev": "error", "rid": rid, "code": "not_found", "message": "no such process with stdin"})
                return
            os.set_blocking(c.stdin, True)
            try:
                os.write(c.stdin, body)
                self.send({"ev": "ok", "rid": rid})
            except OSError as e:
                self.send({"ev": "error", "rid": rid, "code": "failed_precondition", "message": str(e)})
        elif op == "close_stdin":
            c = self.find(h)
            if c is not None and c.stdin is not None:
                os.close(c.stdin)
                c.stdin = None
            self.send(
                {"ev": "ok", "rid": rid}
                if c
                else {"ev": "error", "rid": rid, "code": "not_found", "message": "no such process"}
            )
        elif op == "signal":
            c = self.find(h)
            if c is None:
                self.send({"ev": "error", "rid": rid, "code": "not_found", "message": "no such process"})
                return
            try:  # the whole process group: `bash -c` forwards nothing to its children
                os.killpg(c.pid, int(h["sig"]))
            except ProcessLookupError:
                os.kill(c.pid, int(h["sig"]))
            self.send({"ev": "ok", "rid": rid})
        elif op == "list":
            self.send({"ev": "ok", "rid": rid, "procs": [self.info(c) for c in self.children.values()]})
        elif op == "env":
            self.base_env.update(h.get("envs") or {})
            self.send({"ev": "ok", "rid": rid})
        elif op == "watch":
            self.watch(rid, h)
        elif op == "unwatch":
            if self.inotify is not None:
                self.inotify.remove(h["wid"])
            self.send({"ev": "ok", "rid": rid})
        elif op == "detach":
            self.unwatch_all()
            self.send({"ev": "detached", "rid": rid})
            self.flush_blocking()
            self.drop(hold=True)
        elif op in ("stat", "mkdir", "move", "remove", "list_dir", "read", "wopen", "wdata", "wclose"):
            self.file_op(rid, "list" if op == "list_dir" else op, h, body)
        else:
            self.send({"ev": "error", "rid": rid, "code": "unimplemented", "message": f"unknown op {op!r}"})

    def flush_blocking(self):
        self.conn.setblocking(True)
        with contextlib.suppress(OSError):
            self.conn.sendall(self.wbuf)
        self.wbuf.clear()

    def run(self):
        while True:
            if self.conn is None and self.mode == "seeking":
                self.connect()
            now = time.monotonic()
            for c in list(self.children.values()):  # a command ended but a grandchild still holds its pipe
                if c.exited_at is not None and now - c.exited_at > EXIT_GRACE:
                    self.maybe_end(c, force=True)
            rl = [self.wake_r]
            if len(self.wbuf) < OUT_CAP:
                rl += list(self.fds)
            if self.inotify is not None:
                rl.append(self.inotify.fd)
            if self.conn is not None:
                rl.append(self.conn)
            wl = [self.conn] if self.conn is not None and self.wbuf else []
            if any(c.exited_at is not None for c in self.children.values()):
                timeout = EXIT_GRACE / 2
            elif self.conn is None and self.mode == "seeking":
                timeout = POLL
            else:
                timeout = None
            r, w, _ = select.select(rl, wl, [], timeout)
            for fd in r:
                if fd == self.wake_r:
                    sigs = os.read(self.wake_r, 512)
                    if signal.SIGUSR1 in sigs and self.conn is None:
                        self.mode = "seeking"
                    self.reap()
                elif fd is self.conn:
                    try:
                        data = self.conn.recv(1 << 20)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        self.drop(hold=False)
                        continue
                    self.rbuf += data
                    for h, body in self.frames():
                        self.handle(h, body)
                        if self.conn is None:
                            break
                elif self.inotify is not None and fd == self.inotify.fd:
                    self.pump_inotify()
                elif fd in self.fds:
                    self.pump_child(fd)
            self.pump_reads()
            if self.conn is not None and self.wbuf and (w or len(self.wbuf) > 0):
                try:
                    n = self.conn.send(self.wbuf)
                    del self.wbuf[:n]
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    self.drop(hold=False)


class Inotify:
    """Directory watches through libc's inotify; loaded only when a client asks for one."""

    MASK = 0x100 | 0x2 | 0x8 | 0x200 | 0x40 | 0x80 | 0x4  # CREATE MODIFY CLOSE_WRITE DELETE MOVED_* ATTRIB
    KINDS = ((0x100, 1), (0x2, 2), (0x8, 2), (0x200, 3), (0x40, 4), (0x80, 4), (0x4, 5))

    def __init__(self):
        import ctypes

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.wds = {}  # wd -> (wid, dir path, root path, recursive)

    def add(self, wid, path, recursive):
        self._add(wid, path, path, recursive)
        if recursive:
            for d, subdirs, _ in os.walk(path):
                for s in subdirs:
                    self._add(wid, os.path.join(d, s), path, True)

    def _add(self, wid, path, root, recursive):
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(path), self.MASK)
        if wd >= 0:
            self.wds[wd] = (wid, path, root, recursive)

    def remove(self, wid):
        for wd, (w, *_) in list(self.wds.items()):
            if w == wid:
                self.libc.inotify_rm_watch(self.fd, wd)
                del self.wds[wd]

    def read(self):
        try:
            buf = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        out, i = [], 0
        while i + 16 <= len(buf):
            wd, mask, _cookie, ln = struct.unpack_from("iIII", buf, i)
            name = buf[i + 16 : i + 16 + ln].rstrip(b"\0").decode(errors="replace")
            i += 16 + ln
            if wd not in self.wds:
                continue
            wid, d, root, recursive = self.wds[wd]
            full = os.path.join(d, name)
            rel = os.path.relpath(full, root)
            for bit, kind in self.KINDS:
                if mask & bit:
                    out.append((wid, rel, kind))
                    break
            if recursive and mask & 0x100 and mask & 0x40000000:  # a new subdirectory: watch it too
                self._add(wid, full, root, True)
        return out

    def close(self):
        wids = {w for w, *_ in self.wds.values()}
        os.close(self.fd)
        return wids


def mount_devpts():
    """A devpts instance of the sandbox's own at /dev/pts (under bwrap /dev is a plain directory; gVisor brings
    its own). mount(8) in a child, so that the agent needs no ctypes (import time and pages every dump copies)."""
    if os.path.exists("/dev/pts/ptmx") or not os.path.isdir("/dev/pts"):
        return
    with contextlib.suppress(OSError):
        pid = os.posix_spawn(
            "/usr/bin/mount",
            ["mount", "-t", "devpts", "-o", "newinstance,ptmxmode=0666,mode=0620", "devpts", "/dev/pts"],
            {"PATH": "/usr/bin:/bin"},
        )
        os.waitpid(pid, 0)


def main():
    # CRIU can only dump what lives inside the sandbox: no fd may point at a host file
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, MAXFD)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the agent
    mount_devpts()
    Agent(sys.argv[1] if len(sys.argv) > 1 else "").run()


if __name__ == "__main__":
    main()
