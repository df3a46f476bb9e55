"""TLS fixtures for gpu_preflight's tests: a throw-away CA and a loopback TLS proxy.

make_test_ca(dirpath) writes, with the openssl command-line tool (EC P-256 keys):
  ca.pem, ca.key            a test certificate authority
  server.pem, server.key    CN=localhost, subjectAltName DNS:localhost, IP:127.0.0.1,
                            signed by that CA (valid now, for 825 days)
  other.pem, other.key      a self-signed certificate for the same names, not from the CA
  expired.pem, expired.key  signed by the CA for the same names, valid only in 2020
and returns their paths in a dict (keys: dir, ca, ca_key, server_cert, server_key,
other_cert, other_key, expired_cert, expired_key).

TLSProxy(backend_url, certfile, keyfile) listens on a loopback port, terminates TLS
with that certificate and pipes each connection's bytes unchanged to the backend
(an emulator's http:// URL) and back, as they come: a backend that hangs makes the
proxy hang, a trickle stays a trickle, a backend that closes mid-body closes the
client's connection there.  A backend that refuses the connection gets the client
a "502 Bad Gateway", as a reverse proxy answers.

    ca = make_test_ca(tmpdir)
    with OpenAIEmulator() as emu, TLSProxy(emu.url, ca["server_cert"], ca["server_key"]) as px:
        ... px.url is "https://127.0.0.1:PORT" ...

Standard library only (plus the openssl binary for make_test_ca), CPython 3.6+.
"""

import os
import select
import shutil
import socket
import ssl
import subprocess
import threading

from emu_base import Service, shutdown_sockets

_CONFIG = """\
[req]
distinguished_name = req_dn
prompt = no

[req_dn]
CN = localhost

[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash

[v3_self]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
subjectKeyIdentifier = hash

[v3_server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid

[ca]
default_ca = test_ca

[test_ca]
database = index.txt
new_certs_dir = .
serial = serial.txt
default_md = sha256
policy = policy_any
unique_subject = no
copy_extensions = none
email_in_dn = no

[policy_any]
commonName = supplied
"""

# The window of the expired certificate (UTCTime, as openssl ca and x509 accept it).
EXPIRED_NOT_BEFORE = "200101000000Z"
EXPIRED_NOT_AFTER = "200201000000Z"


def _openssl():
    path = shutil.which("openssl")
    if path is None:
        raise RuntimeError("make_test_ca needs the openssl command-line tool "
                           "(Debian package openssl); it is not on PATH")
    return path


def _run(openssl, args, cwd):
    proc = subprocess.Popen([openssl] + args, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError("openssl %s failed (exit %d): %s" % (
            " ".join(args), proc.returncode,
            (err or out).decode("utf-8", "replace").strip()))
    return out.decode("utf-8", "replace")


def _x509_has_not_before(openssl, cwd):
    """Whether 'openssl x509' takes -not_before/-not_after (OpenSSL 3.4 and later)."""
    proc = subprocess.Popen([openssl, "x509", "-help"], cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return b"-not_before" in proc.communicate()[0]


def _sign_expired(run, dirpath, has_not_before):
    """expired.pem: expired.csr signed by the CA, valid only in January 2020."""
    if has_not_before:                          # OpenSSL 3.4+: x509 sets the dates itself
        try:
            run("x509", "-req", "-in", "expired.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-set_serial", "4", "-not_before", EXPIRED_NOT_BEFORE,
                "-not_after", EXPIRED_NOT_AFTER, "-sha256", "-extfile", "openssl.cnf",
                "-extensions", "v3_server", "-out", "expired.pem")
            return
        except RuntimeError:
            pass                                # fall back on 'openssl ca', which has them
    with open(os.path.join(dirpath, "index.txt"), "w"):
        pass                                    # the CA database 'openssl ca' needs
    with open(os.path.join(dirpath, "serial.txt"), "w") as fh:
        fh.write("04\n")
    run("ca", "-batch", "-config", "openssl.cnf", "-name", "test_ca", "-cert", "ca.pem",
        "-keyfile", "ca.key", "-in", "expired.csr", "-out", "expired.pem", "-notext",
        "-startdate", EXPIRED_NOT_BEFORE, "-enddate", EXPIRED_NOT_AFTER,
        "-extfile", "openssl.cnf", "-extensions", "v3_server")


def make_test_ca(dirpath):
    """Write a test CA and certificates under dirpath; return a dict of their paths."""
    openssl = _openssl()
    dirpath = os.path.abspath(dirpath)
    if not os.path.isdir(dirpath):
        os.makedirs(dirpath)
    with open(os.path.join(dirpath, "openssl.cnf"), "w") as fh:
        fh.write(_CONFIG)

    def run(*args):
        return _run(openssl, list(args), dirpath)

    for name in ("ca", "server", "other", "expired"):
        run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-out", name + ".key")
        os.chmod(os.path.join(dirpath, name + ".key"), 0o600)
    run("req", "-new", "-x509", "-config", "openssl.cnf", "-extensions", "v3_ca",
        "-key", "ca.key", "-subj", "/CN=gpu_preflight test CA", "-days", "3650",
        "-sha256", "-set_serial", "1", "-out", "ca.pem")
    run("req", "-new", "-x509", "-config", "openssl.cnf", "-extensions", "v3_self",
        "-key", "other.key", "-subj", "/CN=localhost", "-days", "825", "-sha256",
        "-set_serial", "2", "-out", "other.pem")
    for name in ("server", "expired"):
        run("req", "-new", "-config", "openssl.cnf", "-key", name + ".key",
            "-subj", "/CN=localhost", "-out", name + ".csr")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-set_serial", "3", "-days", "825", "-sha256", "-extfile", "openssl.cnf",
        "-extensions", "v3_server", "-out", "server.pem")
    _sign_expired(run, dirpath, _x509_has_not_before(openssl, dirpath))
    for name in ("server.csr", "expired.csr", "04.pem", "index.txt", "index.txt.attr",
                 "index.txt.old", "index.txt.attr.old", "serial.txt", "serial.txt.old"):
        if os.path.exists(os.path.join(dirpath, name)):
            os.remove(os.path.join(dirpath, name))

    def path(name):
        return os.path.join(dirpath, name)

    return {"dir": dirpath, "ca": path("ca.pem"), "ca_key": path("ca.key"),
            "server_cert": path("server.pem"), "server_key": path("server.key"),
            "other_cert": path("other.pem"), "other_key": path("other.key"),
            "expired_cert": path("expired.pem"), "expired_key": path("expired.key")}


def _backend_address(url):
    """(host, port) of an http:// URL such as an emulator's .url."""
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    return host, int(port or 80)


_BAD_GATEWAY = (b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\n"
                b"Content-Length: 52\r\nConnection: close\r\n\r\n"
                b"<html><body><h1>502 Bad Gateway</h1></body></html>\n\n")


class TLSProxy(Service):
    """A loopback TLS-terminating reverse proxy in front of an http:// backend."""

    def __init__(self, backend_url, certfile, keyfile, host="127.0.0.1", port=0):
        Service.__init__(self)
        self.backend = _backend_address(backend_url)
        self.certfile, self.keyfile = certfile, keyfile
        self.host = host
        self.listen_port = port             # 0: a free one
        self.port = None
        self.url = None
        self.handshake_timeout = 10.0
        self.connections = 0                # accepted TCP connections
        self.handshake_failures = 0         # clients that did not complete TLS
        self._listener = None
        self._context = None

    def start(self):
        if self._listener is not None:
            return self
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.certfile, self.keyfile)
        bind_host = "127.0.0.1" if self.host == "localhost" else self.host
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((bind_host, self.listen_port))
            listener.listen(64)
        except BaseException:
            listener.close()
            raise
        self._context, self._listener = context, listener
        self.port = listener.getsockname()[1]
        shown = "[%s]" % self.host if ":" in self.host else self.host
        self.url = "https://%s:%d" % (shown, self.port)
        self._thread = threading.Thread(target=self._accept_loop)
        self._thread.daemon = True
        self._thread.start()
        return self

    # stop(), `with` and _track() come from emu_base.Service.

    def _detach(self):
        listener, self._listener = self._listener, None
        return listener

    def _close(self, listener, conns):
        shutdown_sockets([listener] + conns)
        listener.close()
        for sock in conns:
            try:
                sock.close()
            except OSError:
                pass

    def _accept_loop(self):
        listener = self._listener
        while not self._stop.is_set():
            try:
                readable = select.select([listener], [], [], 0.05)[0]
                if not readable:
                    continue
                raw, _ = listener.accept()
            except (OSError, ValueError):
                if self._stop.is_set():
                    return
                continue
            with self._lock:
                self.connections += 1
            worker = threading.Thread(target=self._serve, args=(raw,))
            worker.daemon = True
            worker.start()

    def _serve(self, raw):
        if not self._track(raw, True):
            raw.close()
            return
        tls = backend = None
        try:
            raw.settimeout(self.handshake_timeout)
            try:
                tls = self._context.wrap_socket(raw, server_side=True)
            except (ssl.SSLError, OSError):
                with self._lock:
                    self.handshake_failures += 1
                return
            tls.settimeout(None)
            self._track(tls, True)
            try:
                backend = socket.create_connection(self.backend, timeout=10)
            except OSError:
                self._bad_gateway(tls)
                return
            backend.settimeout(None)
            self._track(backend, True)
            self._pipe(tls, backend)
        except (OSError, ValueError):
            pass
        finally:
            for sock in (backend, tls, raw):
                if sock is None:
                    continue
                self._track(sock, False)
                try:
                    sock.close()
                except OSError:
                    pass

    def _pipe(self, tls, backend):
        """Copy bytes both ways until either side closes; one thread, one TLS object."""
        while not self._stop.is_set():
            if tls.pending():
                readable = [tls]
            else:
                readable = select.select([tls, backend], [], [], 0.2)[0]
            if tls in readable:
                try:
                    data = tls.recv(65536)
                except ssl.SSLWantReadError:
                    data = None                  # a non-data record: nothing to pass on
                if data == b"":
                    return                       # client closed: drop the backend too
                if data:
                    backend.sendall(data)
            if backend in readable:
                data = backend.recv(65536)
                if data == b"":
                    self._close_notify(tls)
                    return
                tls.sendall(data)

    def _bad_gateway(self, tls):
        """Read the request (head and Content-Length body), answer 502, close cleanly."""
        tls.settimeout(self.handshake_timeout)
        data = b""
        try:
            while b"\r\n\r\n" not in data and len(data) < 65536:
                chunk = tls.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    try:
                        length = int(value.strip())
                    except ValueError:
                        pass
            while len(body) < length:
                chunk = tls.recv(65536)
                if not chunk:
                    return
                body += chunk
            tls.sendall(_BAD_GATEWAY)
        except (OSError, ValueError):
            return
        self._close_notify(tls)

    @staticmethod
    def _close_notify(tls):
        """End the TLS session cleanly (close_notify) after the backend closed."""
        try:
            tls.settimeout(1.0)
            tls.unwrap()
        except (ssl.SSLError, OSError, ValueError):
            pass
