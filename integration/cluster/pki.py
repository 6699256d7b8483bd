"""The local cluster's certificates, made with openssl: one CA for everything (kubeadm makes
several; one is enough for a cluster that lives for a test run), the API server's serving
certificate, client certificates whose subject is the identity RBAC and NodeRestriction see, and
the service-account signing key."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

DAYS = "30"


@dataclass(frozen=True)
class Identity:
    """A client certificate's subject: user name (CN) and groups (O)."""

    file_stem: str
    user: str
    groups: tuple[str, ...] = ()


ADMIN = Identity("admin", "kubernetes-admin", ("system:masters",))
CONTROLLER_MANAGER = Identity("controller-manager", "system:kube-controller-manager")
SCHEDULER = Identity("scheduler", "system:kube-scheduler")
# The API server's identity towards kubelets (logs, exec): system:masters passes kubelet's webhook.
APISERVER_KUBELET_CLIENT = Identity("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",))


def node_identity(node: str) -> Identity:
    """A kubelet's: NodeRestriction lets it touch only its own Node and pods."""
    return Identity(f"kubelet-{node}", f"system:node:{node}", ("system:nodes",))


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}: {proc.stderr.strip()}")


def _subject(identity: Identity) -> str:
    return "".join(f"/O={group}" for group in identity.groups) + f"/CN={identity.user}"


class Pki:
    """Certificates in one folder (0700); made once, reused by later calls."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.ca_cert, self.ca_key = folder / "ca.crt", folder / "ca.key"
        self.sa_key, self.sa_pub = folder / "sa.key", folder / "sa.pub"
        if not self.ca_cert.exists():
            _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                     "-keyout", "ca.key", "-out", "ca.crt", "-days", DAYS, "-subj", "/CN=rdma-netns-local-ca",
                     cwd=folder)
        if not self.sa_key.exists():
            _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=folder)
            _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)

    def _issue(self, stem: str, subject: str, extensions: str) -> tuple[Path, Path]:
        cert, key = self.folder / f"{stem}.crt", self.folder / f"{stem}.key"
        if cert.exists() and key.exists():
            return cert, key
        (self.folder / f"{stem}.ext").write_text(extensions)
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", key.name, "-out", f"{stem}.csr", "-subj", subject, cwd=self.folder)
        _openssl("x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", cert.name, "-days", DAYS, "-extfile", f"{stem}.ext", cwd=self.folder)
        return cert, key

    def client(self, identity: Identity) -> tuple[Path, Path]:
        return self._issue(identity.file_stem, _subject(identity),
                           "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n")

    def server(self, stem: str, name: str, dns: list[str], ips: list[str]) -> tuple[Path, Path]:
        alt = ",".join([f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips])
        return self._issue(stem, f"/CN={name}", "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
                           f"extendedKeyUsage=serverAuth\nsubjectAltName={alt}\n")
