"""The escapes a policy's code could try against the python tool, run through the real entry
point (sandbox.run_python) by a process that plays the trainer.

    python3 tests/sandbox_attacks.py SECRET   # a JSON line per attack; a table on stderr

Run by tests/agent_sandbox_test.py as the caller (root in CI) and as nobody. The process is
the trainer that the code attacks: its command line and environment hold SECRET, it owns a
0600 file holding SECRET, and it listens on a file-bound and an abstract unix socket. Each
attack prints what every step gave (an errno name or 'ok'); the trainer then checks from
outside what the code could not fake (itself alive, nothing left in the sandbox's PID
namespace, no connection on its sockets, SECRET in no output) and names the layer that stopped
the attack from the errno of each step (see LAYERS).
"""
import json
import os
import socket
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo_jax.agent import sandbox  # pylint: disable=wrong-import-position

PRELUDE = '''
import errno, json, os, sys, time
OUT = {}
def attempt(name, fn):
  try:
    OUT[name] = 'ok: ' + repr(fn())[:300]
  except OSError as e:
    code = type(e).__name__ if e.errno is None else errno.errorcode.get(e.errno, str(e.errno))
    OUT[name] = code + ': ' + str(e)[:300]
  except Exception as e:
    OUT[name] = type(e).__name__ + ': ' + str(e)[:300]
def report(**extra):
  print(json.dumps({'steps': OUT, **extra}), flush=True)
def libc_call(name, *args):
  import ctypes  # here: the audit hook, where it is on, refuses the import
  libc = ctypes.CDLL(None, use_errno=True)
  r = getattr(libc, name)(*args)
  if r == -1:
    e = ctypes.get_errno()
    raise OSError(e, os.strerror(e))
  return r
NR = {'x86_64': dict(keyctl=250, bpf=321, perf_event_open=298, mount_setattr=442,
                     pidfd_send_signal=424, clone=56),
      'aarch64': dict(keyctl=219, bpf=280, perf_event_open=241, mount_setattr=442,
                      pidfd_send_signal=424, clone=220)}[os.uname().machine]
def daemon():
  """fork, setsid, fork: a grandchild that would outlive the call; returns in the caller."""
  if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
      os.close(1), os.close(2)  # it does not hold the call's pipes open
      time.sleep(30)
    os._exit(0)
'''

# The layer that each errno of a step points to.
LAYERS = {"EPERM": "seccomp", "ENETUNREACH": "network namespace",
          "ECONNREFUSED": "network namespace", "ESRCH": "PID namespace",
          "ENOENT": "mount namespace (absent)",
          "EROFS": "read-only mounts", "ENOSPC": "tmpfs size", "EFBIG": "RLIMIT_FSIZE",
          "EACCES": "file permissions", "ENOSYS": "seccomp (ENOSYS)",
          "PermissionError": "audit hook", "ModuleNotFoundError": "audit hook",
          "ImportError": "audit hook"}

# name: (code after the prelude, run_python options, what the trainer checks from outside)
ATTACKS = {
    "kill the caller with a pidfd": ("""
        attempt('pidfd_open(trainer)', lambda: os.pidfd_open(TRAINER))
        attempt('pidfd_open(parent)', lambda: os.pidfd_open(os.getppid()))
        attempt('pidfd_send_signal(parent)', lambda: libc_call(
            'syscall', NR['pidfd_send_signal'], 0, 9, None, 0))
        report()
    """, dict(audit=False), "alive"),
    "kill the caller with kill": ("""
        attempt('kill(trainer)', lambda: os.kill(TRAINER, 9))
        attempt('kill(trainer group)', lambda: os.killpg(TRAINER, 9))
        report(parent=os.getppid())
        os.kill(-1, 9)  # every process it may signal: in its namespace only
    """, dict(audit=False), "alive"),
    "daemon: fork, setsid, fork": ("""
        daemon()
        report(ns=os.readlink('/proc/self/ns/pid'))
    """, dict(audit=False, seccomp=False), "no_survivor"),
    "daemon: subprocess (_posixsubprocess)": ("""
        import subprocess
        subprocess.Popen(['/bin/sleep', '30'], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        report(ns=os.readlink('/proc/self/ns/pid'))
    """, dict(audit=False, seccomp=False), "no_survivor"),
    "daemon: libc through cffi": ("""
        import _cffi_backend as b
        lib, i = b.load_library(None), b.new_primitive_type('int')
        call = lambda name: lib.load_function(b.new_function_type((), i, False), name)()
        if call('fork') == 0:
          call('setsid')
          if call('fork') == 0:
            os.close(1), os.close(2)
            time.sleep(30)
          os._exit(0)
        report(ns=os.readlink('/proc/self/ns/pid'))
    """, dict(audit=False, seccomp=False), "no_survivor"),
    "a second process: fork, vfork, posix_spawn, clone": ("""
        def once(fn):
          pid = fn()
          if pid == 0:
            os._exit(0)
          return pid
        attempt('fork', lambda: once(os.fork))
        attempt('posix_spawn', lambda: os.posix_spawn('/bin/true', ['true'], {}))
        attempt('vfork (libc)', lambda: once(lambda: libc_call('vfork')))
        attempt('clone(SIGCHLD)', lambda: once(lambda: libc_call(
            'syscall', NR['clone'], 17, None, None, None, None)))
        attempt('clone(CLONE_VM|SIGCHLD)', lambda: once(lambda: libc_call(
            'syscall', NR['clone'], 0x100 | 17, None, None, None, None)))
        report()
    """, dict(audit=False), "none"),
    "read the caller's command line and environment": ("""
        seen = {}
        for pid in [str(TRAINER), str(os.getppid())] + [p for p in os.listdir('/proc')
                                                        if p.isdigit()]:
          for what in ('cmdline', 'environ'):
            attempt(f'/proc/{pid}/{what}', lambda: open(f'/proc/{pid}/{what}', 'rb').read())
        report()
    """, dict(audit=False), "no_secret"),
    "read the caller's files": ("""
        for path in (PRIVATE, PUBLIC, '/root', '/home', '/tmp', '/etc/passwd', '/etc/shadow'):
          if os.path.isdir(path):
            attempt(path, lambda: os.listdir(path))
          else:
            attempt(path, lambda: open(path).read())
        report()
    """, dict(audit=False), "no_secret"),
    "connect to the caller's unix sockets": ("""
        import socket
        attempt('socket(AF_UNIX)', lambda: socket.socket(socket.AF_UNIX))
        def connect(address):
          fds = socket.socketpair()  # the one socket call left: it cannot be connected again
          return fds[0].connect(address)
        attempt('connect(file socket)', lambda: connect(SOCKET_PATH))
        attempt('stat(file socket)', lambda: os.stat(SOCKET_PATH))
        def connect_new(address):
          s = socket.socket(socket.AF_UNIX)
          s.settimeout(1)
          return s.connect(address)
        attempt('connect(file socket), new socket', lambda: connect_new(SOCKET_PATH))
        attempt('connect(abstract socket)', lambda: connect_new(ABSTRACT))
        attempt('socketpair(AF_INET)', lambda: socket.socketpair(socket.AF_INET))
        report()
    """, dict(audit=False), "no_connection"),
    "network": ("""
        import socket
        attempt('connect(1.1.1.1:53)', lambda: socket.create_connection(('1.1.1.1', 53), 1))
        attempt('interfaces', lambda: [l.split(':')[0].strip()
                                       for l in open('/proc/self/net/dev').readlines()[2:]])
        report()
    """, dict(audit=False), "none"),
    "remount / and /dev/shm read-write": ("""
        import ctypes
        class Attr(ctypes.Structure):
          _fields_ = [(n, ctypes.c_uint64) for n in ('set', 'clr', 'prop', 'userns')]
        for path in (b'/', b'/dev', b'/dev/shm', b'/usr'):
          attempt(f'mount_setattr({path}, rw)', lambda: libc_call(
              'syscall', NR['mount_setattr'], -100, path, 0, ctypes.byref(Attr(0, 1, 0, 0)), 32))
          attempt(f'mount(remount {path} rw)', lambda: libc_call(
              'mount', None, path, None, 0x20 | 0x1000, None))  # MS_REMOUNT | MS_BIND
        attempt('mount(tmpfs on /dev/shm)', lambda: libc_call(
            'mount', b'none', b'/dev/shm', b'tmpfs', 0, None))
        for path in ('/x', '/dev/shm/x', '/dev/x', '/usr/x', '/tmp/x', '/var/tmp/x', '/proc/x'):
          attempt(f'write {path}', lambda: open(path, 'w').write('x'))
        # All capabilities in a user namespace of its own: the mounts it inherits are locked.
        attempt('unshare(NEWUSER|NEWNS)', lambda: libc_call('unshare', 0x10000000 | 0x20000))
        if OUT['unshare(NEWUSER|NEWNS)'].startswith('ok'):
          for path in (b'/', b'/dev', b'/usr'):
            attempt(f'then mount_setattr({path}, rw)', lambda: libc_call(
                'syscall', NR['mount_setattr'], -100, path, 0, ctypes.byref(Attr(0, 1, 0, 0)),
                32))
            attempt(f'then mount(remount {path} rw)', lambda: libc_call(
                'mount', None, path, None, 0x20 | 0x1000, None))
          for path in ('/x', '/usr/x'):
            attempt(f'then write {path}', lambda: open(path, 'w').write('x'))
        report()
    """, dict(audit=False), "none"),
    "fill the disk past the cap": ("""
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        fd = os.open('big', os.O_WRONLY | os.O_CREAT)
        attempt('posix_fallocate(64 MiB)', lambda: os.posix_fallocate(fd, 0, 64 << 20))
        written = 0
        def fill(i):
          global written
          with open(f'f{i}', 'wb') as f:
            for _ in range(7):
              f.write(b'x' * (1 << 20))
              f.flush()
              written += 1 << 20
        for i in range(6):
          attempt(f'write file {i} (7 MiB)', lambda: fill(i))
        attempt('memfd_create', lambda: os.memfd_create('m'))
        report(written=written)
    """, dict(audit=False, disk_bytes=16 << 20, max_file_bytes=8 << 20), "disk"),
    "fill the inodes past the cap": ("""
        # Files that cost no byte: each costs an inode (and kernel memory) all the same.
        import stat
        made = {}
        def flood(kind, make):
          made[kind] = 0
          while True:
            make(f'{kind}{made[kind]}')
            made[kind] += 1
        attempt('inodes: mknod FIFOs', lambda: flood('p', lambda n: os.mknod(n, stat.S_IFIFO)))
        for i, (kind, make) in enumerate((
            ('d', os.mkdir), ('l', lambda n: os.symlink('x', n)),
            ('f', lambda n: os.close(os.open(n, os.O_WRONLY | os.O_CREAT))))):
          os.remove(f'p{i}')  # one inode free for each kind: it must get one, and no more
          attempt(f'inodes: {kind} after one was freed', lambda: flood(kind, make))
        report(made=made)
    """, dict(audit=False, max_inodes=2000), "inodes"),
    "ptrace, new namespaces and kernel interfaces": ("""
        # PTRACE_SEIZE: attaches without stopping the tracee
        attempt('ptrace(SEIZE, trainer)', lambda: libc_call('ptrace', 0x4206, TRAINER, None, None))
        attempt('ptrace(SEIZE, parent)', lambda: libc_call('ptrace', 0x4206, os.getppid(), None,
                                                           None))
        attempt('unshare(NEWUSER)', lambda: libc_call('unshare', 0x10000000))
        attempt('unshare(NEWNET)', lambda: libc_call('unshare', 0x40000000))
        attempt('keyctl(GET_KEYRING_ID)', lambda: libc_call('syscall', NR['keyctl'], 0, -3, 0))
        attempt('bpf(MAP_CREATE)', lambda: libc_call('syscall', NR['bpf'], 0, None, 0))
        attempt('perf_event_open', lambda: libc_call(
            'syscall', NR['perf_event_open'], None, 0, -1, -1, 0))
        report()
    """, dict(audit=False), "none"),
    "switch off the audit hook from inside": ("""
        import builtins
        f = sys._getframe()
        while f is not None:  # up to sandbox_child's frames: empty what its hook refuses
          g = f.f_globals
          if 'REFUSED' in g:
            g['REFUSED'], g['REFUSED_IMPORTS'] = frozenset(), frozenset()
            g['REFUSED_PREFIXES'], g['PATH_EVENTS'] = ('\\0',), {}
          f = f.f_back
        for name in ('ctypes', '_ctypes', '_posixsubprocess', '_cffi_backend'):
          sys.modules.pop(name, None)
        attempt('fork', daemon)
        attempt('import ctypes', lambda: __import__('ctypes'))
        real = builtins.isinstance
        builtins.isinstance = lambda *a: True
        try:
          attempt('fork, isinstance rebound', daemon)
        finally:
          builtins.isinstance = real
        report(ns=os.readlink('/proc/self/ns/pid'))
    """, dict(audit=True), "no_survivor"),
    "switch off the audit hook with a subinterpreter": ("""
        # A subinterpreter starts without the hook: ctypes and fork would then pass it.
        import importlib
        for name in ('_xxsubinterpreters', '_interpreters', '_xxinterpchannels'):
          sys.modules.pop(name, None)
          attempt(f'import {name}', lambda: __import__(name))
          sys.modules.pop(name, None)
          attempt(f'import_module({name})', lambda: importlib.import_module(name))
        report()
    """, dict(audit=True), "none"),
    "read the trainer's keys in /proc/keys": ("""
        def dump(path):
          text = open(path).read()
          print(text, flush=True)  # all of it: the trainer looks for its secret in the output
          return len(text)
        attempt('/proc/keys', lambda: dump('/proc/keys'))
        attempt('/proc/key-users', lambda: dump('/proc/key-users'))
        report()
    """, dict(audit=False), "no_secret"),
    "unsafe mode: leave an unremovable directory": ("""
        # Clean-up must not raise into the trainer (as an ordinary user a 0000 directory can be
        # neither listed nor emptied without a chmod first).
        os.makedirs('d/e')
        open('d/e/f', 'w').write('x')
        os.chmod('d/e', 0), os.chmod('d', 0)
        report(cwd=os.getcwd())
    """, dict(mode="unsafe"), "removed"),
    "ctypes, cffi and _posixsubprocess past the import check": ("""
        import importlib
        for name in ('ctypes', '_ctypes', '_cffi_backend', '_posixsubprocess'):
          attempt(f'import {name}', lambda: __import__(name))
          attempt(f'import_module({name})', lambda: importlib.import_module(name))
        report()
    """, dict(audit=True), "none"),
}
# The same attacks without the seccomp filter: the namespaces and the missing capabilities
# beneath it must hold by themselves.
for _name in ("kill the caller with a pidfd", "connect to the caller's unix sockets", "network",
              "remount / and /dev/shm read-write",
              "ptrace, new namespaces and kernel interfaces"):
  _body, _options, _check = ATTACKS[_name]
  ATTACKS[_name + " (no seccomp)"] = (_body, {**_options, "seccomp": False}, _check)

# Steps that are expected to succeed: they reach nothing outside the sandbox. Without the
# filter some more succeed: a pidfd of the sandbox's own init and, as an ordinary user, ptrace
# of it (same uid, same namespaces; seccomp refuses both), an AF_UNIX socket that can reach
# nothing, nested namespaces (whose mounts are locked), the session keyring's id (keyctl has
# no layer but seccomp: docs/sandbox.md).
HARMLESS = {"interfaces", "kill(trainer group)"}
HARMLESS_WITHOUT_SECCOMP = HARMLESS | {
    "pidfd_open(parent)", "ptrace(SEIZE, parent)", "socket(AF_UNIX)", "unshare(NEWUSER|NEWNS)",
    "unshare(NEWUSER)",
    "unshare(NEWNET)", "keyctl(GET_KEYRING_ID)"}


def _pid_namespace_members(ns: str) -> list[int]:
  """Live processes of the machine in the PID namespace `ns` ('pid:[4026532...]')."""
  members = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      if os.readlink(f"/proc/{pid}/ns/pid") == ns:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
          if f.read().rsplit(")", 1)[1].split()[0] != "Z":
            members.append(int(pid))
    except OSError:
      continue
  return members


def run_attack(name: str, ctx: dict) -> dict:
  """Runs one attack; {'attack', 'escaped', 'layers', 'steps', 'status'}."""
  body, options, check = ATTACKS[name]
  code = PRELUDE + textwrap.dedent(body)
  for key in ("TRAINER", "PRIVATE", "PUBLIC", "SOCKET_PATH", "ABSTRACT"):
    code = code.replace(key, repr(ctx[key.lower()]))
  r = sandbox.run_python(code, timeout_s=5.0, **options)
  lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
  seen = json.loads(lines[-1]) if lines else {"steps": {}}
  steps = seen["steps"]
  harmless = HARMLESS if options.get("seccomp", True) else HARMLESS_WITHOUT_SECCOMP
  escaped = [f"{step}: {what}" for step, what in steps.items()
             if what.startswith("ok") and step not in harmless]
  if name == "network" and steps.get("interfaces") != "ok: ['lo']":
    escaped.append(f"interfaces {steps.get('interfaces')}")
  if check == "no_survivor":
    if not any(step.startswith("fork") for step in steps):
      steps["fork"] = "ok"  # the daemon attacks fork outside attempt()
    # run_python returns once the namespace is empty: no waiting here.
    survivors = _pid_namespace_members(seen["ns"]) if "ns" in seen else []
    escaped = [f"processes outlived the call: {survivors}"] if survivors else []
  elif check == "no_secret":
    if ctx["secret"] in r.stdout + r.stderr:
      escaped.append("the secret was read")
    else:
      escaped = []  # reading what holds no secret (its own /proc, /etc/passwd) is no escape
  elif check == "no_connection":
    for server in ctx["servers"]:
      try:
        server.accept()[0].close()
        escaped.append(f"a connection reached {server.getsockname()!r}")
      except BlockingIOError:
        pass
  elif check == "removed":
    escaped = []  # what it did was its own directory's business; that it is gone is checked
    if "cwd" not in seen or os.path.exists(seen["cwd"]):
      escaped.append(f"the directory was not removed: {seen.get('cwd')}")
    steps["clean-up"] = "PermissionError: removed" if not escaped else "ok"
  elif check == "inodes":
    escaped = []  # making files inside the cap is what the directory is for
    made, cap = seen.get("made", {}), options["max_inodes"]
    # The directory and main.py are 2 of the cap; 3 of the FIFOs were removed.
    if sum(made.values()) - 3 > cap - 2:
      escaped.append(f"made {made} inodes past the {cap} cap")
    if made.get("p", 0) < cap - 2 or any(made.get(k) != 1 for k in "dlf"):
      escaped.append(f"the cap was not where it should be: {made}")
    if r.seconds > 5.0:
      escaped.append(f"the call took {r.seconds:.1f} s")
  elif check == "disk":
    escaped = []  # writing inside the cap is what the directory is for
    if seen.get("written", 0) > options["disk_bytes"]:
      escaped.append(f"wrote {seen['written']} bytes past the {options['disk_bytes']} cap")
  def layer(step: str, what: str) -> str:
    code = what.split(":")[0]
    if step.startswith("/proc/") and code == "ENOENT":
      return "PID namespace"  # the new /proc holds only the sandbox's processes
    if step.startswith("connect(abstract") and code == "ECONNREFUSED":
      return "network namespace"  # abstract names belong to a network namespace
    if step.startswith("then") and code == "EPERM":
      return "locked mounts"  # made in a parent user namespace: no child namespace may change them
    if code in ("EINVAL", "EFAULT", "EBADF", "ENOTSUP"):
      return "the kernel (bad arguments; seccomp alone refuses the call)"
    if step.startswith("inodes") and code == "ENOSPC":
      return "tmpfs inodes"
    if step.startswith("unshare") and code == "ENOSPC":
      return "--disable-userns"  # no user namespace can be made inside the sandbox's
    if code == "EPERM" and not options.get("seccomp", True):
      return "no capability"
    if step == "clean-up":
      return "clean-up (unsafe mode)"
    return LAYERS.get(code, code)
  layers = sorted({layer(step, what) for step, what in steps.items() if not what.startswith("ok")})
  if check == "no_survivor" and "ns" in seen and any(
      what.startswith("ok") for step, what in steps.items() if step.startswith("fork")):
    layers.append("PID namespace (killed with the call)")
  return {"attack": name, "escaped": escaped, "layers": layers, "steps": steps,
          "status": r.status, "stderr": r.stderr[-300:] if not steps else ""}


def _add_key(description: str) -> None:
  """A key in the trainer's session keyring, named `description` (add_key(2), through ctypes:
  the standard library has no keyring call). Where the kernel refuses, the attack on
  /proc/keys has nothing to find, which is said on stderr."""
  import ctypes  # pylint: disable=import-outside-toplevel
  nr = {"x86_64": 248, "aarch64": 217}.get(os.uname().machine)
  libc = ctypes.CDLL(None, use_errno=True)
  if nr is None or libc.syscall(nr, b"user", description.encode(), b"x", 1, -3) == -1:
    print(f"add_key: {os.strerror(ctypes.get_errno())}: /proc/keys holds no key of ours",
          file=sys.stderr)


def main() -> None:
  secret = sys.argv[1]
  home = tempfile.mkdtemp(prefix="grpo_attack_")
  private = os.path.join(home, "private_token")
  with open(os.open(private, os.O_WRONLY | os.O_CREAT, 0o600), "w", encoding="ascii") as f:
    f.write(secret)
  public = os.path.join(home, "public_token")
  with open(public, "w", encoding="ascii") as f:
    f.write(secret)
  os.chmod(public, 0o644)
  os.chmod(home, 0o755)
  socket_path = os.path.join(home, "trainer.sock")
  servers = []
  abstract = f"\0grpo_sandbox_trainer_{os.getpid()}"
  for address in (socket_path, abstract):
    server = socket.socket(socket.AF_UNIX)
    server.bind(address)
    server.listen()
    server.setblocking(False)
    servers.append(server)
  os.chmod(socket_path, 0o777)
  _add_key(f"grpo_trainer_{secret}")
  ctx = dict(trainer=os.getpid(), private=private, public=public, socket_path=socket_path,
             abstract=abstract, secret=secret, servers=servers)
  try:
    sandbox.check("strict")
    names = sys.argv[2:] or list(ATTACKS)
    uid = os.getuid()
    print(f"| attack (trainer uid {uid}) | escaped | stopped by |\n|---|---|---|", file=sys.stderr)
    for name in names:
      result = run_attack(name, ctx)
      print(json.dumps(result), flush=True)
      print(f"| {name} | {'; '.join(result['escaped']) or 'no'} | "
            f"{', '.join(result['layers'])} |", file=sys.stderr, flush=True)
  finally:
    for server in servers:
      server.close()
    for path in (private, public, socket_path):
      os.remove(path)
    os.rmdir(home)


if __name__ == "__main__":
  main()
