"""``pip install`` inside a sandbox, under a policy that allows the package index and nothing else.

The index is the test's own: a wheel it writes, served over HTTP from the test's network namespace
(198.18.x.2: nothing leaves the machine). The sandbox runs a Debian template with pip and venv, from
the root filesystem ``scripts/bootstrap`` builds once per machine (debootstrap needs Debian's mirror,
which a test may not reach).
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.networks import net_engine  # noqa: F401 - a fixture
from tests.support.debian import DEBIAN, require_root_filesystem
from tests.support.engine import EngineProcess
from tests.support.netns import Server, allow, serve_directory, server  # noqa: F401 - a fixture

pytestmark = [pytest.mark.root, pytest.mark.slow]
INDEX_PORT = 8090
VALUE = "came from the test's own index"


def _wheel(directory: Path) -> Path:
    """fytiny 1.0: a pure-Python wheel, written by hand (no build backend, no download)."""
    files = {
        "fytiny/__init__.py": f"VALUE = {VALUE!r}\n".encode(),
        "fytiny-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: fytiny\nVersion: 1.0\n",
        "fytiny-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: forkyard-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for name, data in files.items()
    )
    files["fytiny-1.0.dist-info/RECORD"] = (record + "fytiny-1.0.dist-info/RECORD,,\n").encode()
    wheel = directory / "fytiny-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel


@pytest.fixture
def index(tmp_path: Path, server: Server) -> Iterator[str]:  # noqa: F811 - the fixture above
    """A simple index (PEP 503) with fytiny, over HTTP on the server's namespace; its URL."""
    root = tmp_path / "index"
    (root / "simple" / "fytiny").mkdir(parents=True)
    wheel = _wheel(root)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (root / "simple" / "fytiny" / "index.html").write_text(
        f'<html><body><a href="../../{wheel.name}#sha256={digest}">{wheel.name}</a></body></html>\n'
    )
    with serve_directory(server.namespace, server.address, INDEX_PORT, root) as url:
        yield f"{url}simple/"


def test_pip_installs_from_an_index_the_policy_allows_and_not_without_it(
    net_engine: EngineProcess,  # noqa: F811 - the fixture above
    server: Server,  # noqa: F811
    index: str,
):
    require_root_filesystem(DEBIAN, "usr/bin/pip3")
    # Plain HTTP, as a private mirror may be: pip wants the host named as trusted for that.
    pip = (
        "/tmp/venv/bin/pip install --disable-pip-version-check --no-cache-dir --retries 0 --timeout 5"
        f" --index-url {index} --trusted-host {server.address} fytiny"
    )
    with net_engine.client(timeout_s=300) as client:
        client.import_template("debian-pip", str(DEBIAN), "directory", replace=True)
        allowed = client.create(template="debian-pip", size="default", ttl_s=600, network=allow(server, INDEX_PORT))["id"]
        refused = client.create(template="debian-pip", size="default", ttl_s=600, network=allow(server, 8080))["id"]
        try:
            for sandbox in (allowed, refused):
                made = client.exec(sandbox, "python3 -m venv /tmp/venv", timeout_s=120)
                assert made.exit_code == 0, made.stderr
            installed = client.exec(
                allowed, f"{pip} && /tmp/venv/bin/python -c 'import fytiny; print(fytiny.VALUE)'", timeout_s=120
            )
            assert installed.exit_code == 0, installed.stdout + installed.stderr
            assert installed.stdout.decode().strip().endswith(VALUE)
            blocked = client.exec(refused, pip, timeout_s=120)
            assert blocked.exit_code != 0
            # Visible, not silent: the refused connection is in the sandbox's denied log.
            denied = client.call("stats", id=refused)["network"]["denied"]
            assert any(item["address"] == server.address and item["port"] == INDEX_PORT for item in denied), denied
        finally:
            client.destroy(allowed)
            client.destroy(refused)
