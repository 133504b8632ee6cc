"""The command lines the engine builds for a model server, per kind (no root, nothing started)."""

from __future__ import annotations

from pathlib import Path

from sandboxes.engine.model_servers import ModelServers, ServerRecord


def servers(tmp_path: Path, vllm_command: str = "") -> ModelServers:
    return ModelServers(tmp_path, "127.0.0.1", "nobody", pidfd_open=lambda pid: -1, vllm_command=vllm_command)


def record(kind: str) -> ServerRecord:
    return ServerRecord(id="ep_1", kind=kind, model="/models/m", name="judge", token="t0ken", context_length=4096, port=18000)


def test_vllm_is_started_without_flags_its_current_releases_refuse_and_with_its_caches_its_own(tmp_path: Path) -> None:
    argv, environment = servers(tmp_path, "vllm serve")._argv(record("vllm"))
    assert argv[:2] == ["vllm", "serve"]
    assert argv[argv.index("--served-model-name") + 1] == "judge"
    assert argv[argv.index("--max-model-len") + 1] == "4096"
    assert argv[argv.index("--port") + 1] == "18000"
    assert argv[-1] == "--server-id=ep_1"  # how a restarted engine knows its process again
    # Removed in vLLM 0.12: a server given it does not start (request logging is off by default since 0.10).
    assert "--disable-log-requests" not in argv
    assert environment["VLLM_LOGGING_LEVEL"] == "WARNING"  # releases before 0.10 log requests at INFO
    assert environment["VLLM_API_KEY"] == "t0ken" and "t0ken" not in " ".join(argv)  # not in ps
    cache = tmp_path / "model-servers" / "ep_1.cache"
    assert environment["XDG_CACHE_HOME"] == str(cache)
    assert environment["VLLM_CACHE_ROOT"].startswith(str(cache)) and environment["HF_HOME"].startswith(str(cache))


def test_the_llama_cpp_server_gets_its_token_in_the_environment_not_in_argv(tmp_path: Path) -> None:
    argv, environment = servers(tmp_path)._argv(record("llama_cpp"))
    assert argv[1:3] == ["-m", "sandboxes.engine.llama_server"]
    assert environment["FORKYARD_MODEL_SERVER_TOKEN"] == "t0ken" and "t0ken" not in " ".join(argv)
    assert argv[-1] == "--server-id=ep_1"
