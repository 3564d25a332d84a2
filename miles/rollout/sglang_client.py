"""Rollout on external SGLang servers (or `miles serve`), through SGLang's native HTTP API.

`--rollout-backend sglang --sglang-url URL[,URL...]` sends every request to one of the servers
(round robin; a router's URL works as one server) as `POST /generate` with `input_ids`,
`sampling_params` (the request's own `sampling_seed`, so a fixed-seed run samples the same
tokens as the in-process engine), `return_logprob` and, for MoE models, `return_routed_experts`
(R3). At most --sglang-max-concurrency requests are in flight. A connection error or a 5xx
answer is retried on the next server with exponential backoff, up to --sglang-retries times
per server; a server that keeps failing is skipped until a request finds every other server
down too. A server that cannot be reached for a disk weight update is set aside (the others
take the update) and gets no requests until it is back and has loaded the current weights, so a
server killed and restarted mid-run rejoins it; when no server takes an update the run stops.
A 4xx answer, or a response that lacks what miles needs (token ids, one log-prob per token,
routed experts of the right shape), stops the run with the server and the field named.

Weights go to the servers from disk (--sglang-weight-transport disk): the trainer's tensors are
written as a checkpoint (safetensors + config.json) under --sglang-weight-dir, then
`POST /update_weights_from_disk` with `model_path` and `weight_version`; the servers must see
that directory (one host, or a shared filesystem). Or over SGLang's weight-update group
(--sglang-weight-transport distributed): `POST /init_weights_update_group` once (this process
rank 0, each server's ranks after it), then per update `POST /update_weights_from_distributed`
with the names, dtypes and shapes while this process broadcasts the tensors
(`miles.sync.sglang_group`). Either way every server must answer success. `states()` reads the weights back through
`POST /get_weights_by_name` for --check-weight-update-equal.
"""

from __future__ import annotations

import base64
import http.client
import itertools
import json
import logging
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.data.sample import Sample, Status
from miles.errors import MilesError
from miles.rollout.sampling import Request

log = logging.getLogger("miles")

MIN_SGLANG = (
    0,
    4,
    6,
)  # /generate with input_ids + sampling_seed, update_weights_from_disk, get_weights_by_name
FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
RETRY_STATUS = {500, 502, 503, 504}
READMIT_PROBE_S = 5.0  # seconds a set-aside server has to answer before each rollout


class ServerError(MilesError):
    """A server answered in a way miles cannot use (or none answered)."""


class NoServerAnswered(ServerError):
    """Every server tried was unreachable (connection errors, 5xx) after the retries."""


class Unreachable(Exception):
    """A connection-level failure: the request may be redone on another server."""


@dataclass
class Server:
    url: str
    failures: int = 0  # consecutive connection failures
    stale: bool = False  # missed a weight update: no requests until it has loaded the current weights

    def __str__(self) -> str:
        return self.url


def parse_version(text: str) -> tuple[int, ...] | None:
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g or 0) for g in m.groups()) if m else None


class SGLangRollout:
    """A `Rollout` (see `miles.runtime.protocols`) over SGLang-compatible HTTP servers."""

    def __init__(
        self,
        urls: Sequence[str],
        tokenizer,
        model_config,
        weight_dir: str | Path,
        max_concurrency: int = 32,
        retries: int = 3,
        timeout: float = 600.0,
        backoff: float = 0.2,
        transport: str = "disk",
        master_address: str | None = None,
    ) -> None:
        if not urls:
            raise ServerError("--sglang-url: no server given")
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.tokenizer, self.model_config = tokenizer, model_config
        self.weight_dir = Path(weight_dir)
        self.max_concurrency, self.retries, self.timeout, self.backoff = (
            max_concurrency,
            retries,
            timeout,
            backoff,
        )
        self.moe = getattr(model_config, "num_experts", 0) or 0
        self.restarts = 0  # requests redone on another server
        self.placement = None  # the training ranks' Ray placement, when they run on Ray
        self._version = 0
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self.transport, self.master_address = transport, master_address
        self.group = None  # the weight-update group, joined at the first distributed update
        self._shapes: dict[str, list[int]] = {}  # name -> shape of the last update's tensors
        self._disk_update: dict = {}  # the last /update_weights_from_disk body, for a server that missed it
        self.server_info = {str(s): self._server_info(s) for s in self.servers}
        self.server_versions = {url: str(info.get("version")) for url, info in self.server_info.items()}

    # -- HTTP -------------------------------------------------------------------------------
    def _call(self, server: Server, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """One request; `Unreachable` for what another server could answer, `ServerError` else."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            server.url + path, data=data, method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            if e.code in RETRY_STATUS:
                raise Unreachable(f"{server.url}{path}: HTTP {e.code} {detail}") from e
            raise ServerError(f"{server.url}{path}: HTTP {e.code}: {detail}") from e
        except (
            urllib.error.URLError,
            ConnectionError,
            TimeoutError,
            http.client.HTTPException,
            OSError,
        ) as e:
            raise Unreachable(f"{server.url}{path}: {type(e).__name__}: {e}") from e
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise ServerError(f"{server.url}{path}: the response is not JSON ({e}): {raw[:200]!r}") from e

    def _server_info(self, server: Server) -> dict:
        """The server's /get_server_info; an SGLang older than MIN_SGLANG is refused."""
        info = self._with_retries(lambda s: self._call(s, "/get_server_info", timeout=30), [server])
        info = info if isinstance(info, dict) else {}
        version = str(info.get("version", ""))
        if version.startswith("miles"):
            return info
        found = parse_version(version)
        if found is None or found < MIN_SGLANG:
            need = ".".join(map(str, MIN_SGLANG))
            raise ServerError(
                f"--sglang-url {server.url}: server version {version or 'unknown'!r}; miles needs SGLang >= {need} "
                "(/generate with input_ids and sampling_seed, /update_weights_from_disk, /get_weights_by_name)"
            )
        return info

    def _with_retries(self, call, servers: list[Server] | None = None):
        """`call(server)` on the servers in turn until one answers; backoff doubles per round."""
        pool = servers or self.servers
        errors = []
        for attempt in range(self.retries * len(pool)):
            current = [s for s in pool if not s.stale] or pool
            live = [s for s in current if s.failures < self.retries] or current  # all failing: try them all
            with self._lock:
                server = live[next(self._turn) % len(live)]
            try:
                out = call(server)
                server.failures = 0
                return out
            except Unreachable as e:
                server.failures += 1
                errors.append(str(e))
                if attempt + 1 < self.retries * len(pool):
                    with self._lock:
                        self.restarts += 1
                    time.sleep(self.backoff * 2 ** (attempt // len(pool)))
        raise NoServerAnswered(f"no server answered after {len(errors)} tries; last: {errors[-1]}")

    # -- rollout ----------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[Request]) -> list[Sample]:
        requests = list(requests)
        if not requests:
            return []
        self._readmit()
        with ThreadPoolExecutor(min(self.max_concurrency, len(requests))) as pool:
            return list(pool.map(self._generate_one, requests))

    def _body(self, request: Request) -> dict:
        p = request.params
        params: dict[str, Any] = {
            "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "max_new_tokens": p.max_new_tokens,
            "ignore_eos": p.ignore_eos, "skip_special_tokens": False,
        }  # fmt: skip
        if p.stop_token_ids:
            params["stop_token_ids"] = list(p.stop_token_ids)
        if p.stop:
            params["stop"] = list(p.stop)
        if p.seed is not None:
            params["sampling_seed"] = int(p.seed)
        body = {"input_ids": list(request.prompt_ids), "sampling_params": params, "return_logprob": True}
        if (
            request.images is not None
        ):  # the ids hold the images' expanded tokens; the server makes the pixels
            body["image_data"] = list(request.images["image_data"])
        if self.moe:
            body["return_routed_experts"] = True
        return body

    def _generate_one(self, request: Request) -> Sample:
        body = self._body(request)
        return self._with_retries(lambda s: self.to_sample(request, self._call(s, "/generate", body), s.url))

    def to_sample(self, request: Request, out: Any, url: str) -> Sample:
        """The server's answer as a `Sample`, every field miles relies on checked."""
        where = f"{url}/generate"
        if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
            raise ServerError(f"{where}: the response has no 'meta_info' object: {str(out)[:200]}")
        meta = out["meta_info"]
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list):
            raise ServerError(
                f"{where}: meta_info.output_token_logprobs is missing (is return_logprob supported?)"
            )
        ids = out.get("output_ids")
        if ids is None:  # older servers: the ids are the logprob entries' second items
            ids = [e[1] for e in entries if isinstance(e, list) and len(e) >= 2]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ServerError(f"{where}: output_ids is not a list of token ids")
        if len(entries) != len(ids):
            raise ServerError(
                f"{where}: {len(entries)} log-probs for {len(ids)} output tokens (a partial response?)"
            )
        logprobs = []
        for i, (entry, token) in enumerate(zip(entries, ids)):
            if not (isinstance(entry, list) and len(entry) >= 2 and entry[1] == token):
                raise ServerError(
                    f"{where}: output_token_logprobs[{i}] = {entry!r} does not match token {token}"
                )
            lp = entry[0]
            if not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-6:
                raise ServerError(
                    f"{where}: output_token_logprobs[{i}] has log-prob {lp!r} (want a finite value <= 0)"
                )
            logprobs.append(float(lp))
        reason = meta.get("finish_reason") or {"type": "abort"}
        if isinstance(reason, str):
            reason = {"type": reason}
        status = FINISH.get(reason.get("type"))
        if status is None:
            raise ServerError(f"{where}: unknown finish_reason {reason!r}")
        version = _int_version(meta.get("weight_version"), self._version)
        sample = request.sample if request.sample is not None else Sample()
        if request.images is not None:  # what training replays the response against
            sample.multimodal_train_inputs = request.images
        sample.tokens = list(request.prompt_ids) + ids
        sample.response_length = len(ids)
        sample.rollout_log_probs = logprobs
        sample.loss_mask = [1] * len(ids)
        sample.status = status
        sample.weight_versions = [version]
        sample.token_versions = [version] * len(ids)
        sample.metadata["request_id"] = meta.get("id")
        sample.metadata["finish_reason"] = reason
        sample.metadata["server"] = url
        sample.response = (
            self.tokenizer.decode(ids, skip_special_tokens=True)
            if self.tokenizer is not None
            else out.get("text", "")
        )
        if self.moe:
            sample.rollout_routed_experts = self._routed(
                meta.get("routed_experts"), len(sample.tokens) - 1, where
            )
        return sample

    def _routed(self, raw: Any, rows: int, where: str) -> np.ndarray:
        """SGLang's base64 int32 bytes (or miles serve's nested lists) as (tokens - 1, layers, k)."""
        layers, k = self.model_config.num_hidden_layers, self.model_config.num_experts_per_tok
        if raw is None:
            raise ServerError(
                f"{where}: no meta_info.routed_experts (start SGLang with --enable-return-routed-experts)"
            )
        try:
            flat = (
                np.frombuffer(base64.b64decode(raw), dtype=np.int32)
                if isinstance(raw, str)
                else np.asarray(raw, dtype=np.int32).reshape(-1)
            )
        except (ValueError, TypeError) as e:
            raise ServerError(f"{where}: meta_info.routed_experts cannot be read: {e}") from e
        if flat.size != rows * layers * k:
            raise ServerError(
                f"{where}: meta_info.routed_experts has {flat.size} ids; want {rows} tokens x {layers} layers x {k}"
            )
        return flat.reshape(rows, layers, k)

    # -- weights ----------------------------------------------------------------------------
    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Every server takes these weights: from disk, or broadcast over the weight-update group."""
        version = self._version + 1 if version is None else version
        named = list(named)
        self._check_adapters_served(named)
        if self.transport == "distributed":
            self._update_distributed(named, version)
        else:
            self._update_from_disk(named, version)
        self._version = version
        self._shapes = {name: list(t.shape) for name, t in named}

    def _check_adapters_served(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """A LoRA sync needs servers that merge adapters (miles serve)."""
        from miles.lora.serving import is_adapter_update

        stock = [url for url, v in self.server_versions.items() if not v.startswith("miles")]
        if stock and any(is_adapter_update(n) for n, _ in named):
            raise MilesError(
                f"--lora-rank with --sglang-url {stock[0]} (version {self.server_versions[stock[0]]}): miles sends "
                "LoRA adapters alone, which `miles serve` merges; a stock SGLang server loads whole weights only. "
                "Serve with `miles serve`, or train without --lora-rank"
            )

    def _update_from_disk(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write the tensors as a checkpoint under --sglang-weight-dir and have every server load it."""
        from safetensors.torch import save_file

        from miles.lora.peft_files import save_sync_adapter
        from miles.lora.serving import is_adapter_update
        from miles.models.checkpoint import atomic_directory

        path = self.weight_dir / "current"
        with atomic_directory(path) as tmp:
            if any(is_adapter_update(k) for k, _ in named):  # LoRA: a PEFT adapter for the served base
                save_sync_adapter(dict(named), tmp)
            else:
                tensors = {k: v.detach().to("cpu").contiguous() for k, v in named}
                save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
                (tmp / "config.json").write_text(json.dumps(self.model_config.to_hf_dict(), indent=2))
        body = {"model_path": str(path.resolve()), "weight_version": str(version)}
        missed = []
        for server in self.servers:
            try:
                out = self._with_retries(lambda s: self._call(s, "/update_weights_from_disk", body), [server])
            except NoServerAnswered as e:
                missed.append((server, str(e)))
                continue
            if not (isinstance(out, dict) and out.get("success")):
                raise ServerError(
                    f"{server.url}/update_weights_from_disk: the server did not load {path}: {out}"
                )
            server.stale = False
        if len(missed) == len(self.servers):
            raise ServerError(f"no server took weight version {version}; last: {missed[-1][1]}")
        for server, why in missed:
            if not server.stale:
                log.warning(
                    "%s missed weight version %d (%s); it gets no requests until it is back",
                    server,
                    version,
                    why,
                )
            server.stale = True
        self._disk_update = body

    def _readmit(self) -> None:
        """A server set aside for a missed update serves again once it has loaded the current weights."""
        for server in [s for s in self.servers if s.stale]:
            try:
                # a host that is down costs the short probe, not the weight update's timeout
                self._call(server, "/get_server_info", timeout=READMIT_PROBE_S)
                out = self._call(server, "/update_weights_from_disk", self._disk_update, timeout=self.timeout)
            except (Unreachable, ServerError):
                continue  # still down: ask again before the next batch
            if isinstance(out, dict) and out.get("success"):
                server.stale, server.failures = False, 0
                log.warning("%s is back with weight version %s", server, self._disk_update["weight_version"])

    def _on_every_server(self, path: str, bodies: list[dict], while_waiting=None) -> None:
        """POST bodies[i] to server i, all at once (each call blocks until the group acts), running
        `while_waiting()` meanwhile; every server must answer success."""
        with ThreadPoolExecutor(len(self.servers)) as pool:
            futures = [pool.submit(self._call, s, path, b) for s, b in zip(self.servers, bodies)]
            if while_waiting is not None:
                while_waiting()
            for server, fut in zip(self.servers, futures):
                try:
                    out = fut.result()
                except Unreachable as e:
                    raise ServerError(f"{e} (a server left the weight-update group)") from e
                if not (isinstance(out, dict) and out.get("success")):
                    raise ServerError(f"{server.url}{path}: {out}")

    def _join_group(self, backend: str) -> None:
        """Form SGLang's weight-update group: this process rank 0, each server's TP ranks after."""
        import socket
        from urllib.parse import urlparse

        from miles.sync.group import free_port
        from miles.sync.sglang_group import GROUP_NAME, init_custom_process_group

        address = self.master_address
        if address is None:  # the address this host reaches the first server from
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect((urlparse(self.servers[0].url).hostname, 9))
                address = sock.getsockname()[0]
        port = free_port()
        sizes = [int(self.server_info[str(s)].get("tp_size", 1)) for s in self.servers]
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world = 1 + sum(sizes)
        bodies = [
            {"master_address": address, "master_port": port, "rank_offset": o, "world_size": world,
             "group_name": GROUP_NAME, "backend": backend}
            for o in offsets
        ]  # fmt: skip
        groups = []
        init = f"tcp://{address}:{port}"
        self._on_every_server(
            "/init_weights_update_group",
            bodies,
            lambda: groups.append(init_custom_process_group(backend, init, world, 0, GROUP_NAME)),
        )
        self.group = groups[0]

    def _update_distributed(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        from miles.sync.sglang_group import GROUP_NAME, broadcast_tensors

        backend = "nccl" if named and named[0][1].is_cuda else "gloo"
        if self.group is None:
            self._join_group(backend)
        body = {
            "names": [n for n, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "group_name": GROUP_NAME, "weight_version": str(version), "flush_cache": True,
        }  # fmt: skip
        self._on_every_server(
            "/update_weights_from_distributed",
            [body] * len(self.servers),
            lambda: broadcast_tensors(self.group, (t for _, t in named)),
        )

    def states(self) -> list[dict[str, torch.Tensor]]:
        """Each server's weights, read back by name (the tensors of the last update)."""
        out = []
        for server in [s for s in self.servers if not s.stale]:  # a set-aside server serves nothing
            state = {}
            for name, shape in self._shapes.items():
                body = {"name": name, "truncate_size": max(1, int(np.prod(shape)))}
                values = self._with_retries(
                    lambda s, b=body: self._call(s, "/get_weights_by_name", b), [server]
                )
                state[name] = torch.tensor(values, dtype=torch.float32).reshape(shape)
            out.append(state)
        return out

    # -- the rest of the Rollout interface ----------------------------------------------------
    def node_ids(self) -> list[str]:
        return [s.url for s in self.servers]

    def peak_memory(self) -> list[dict[str, int]]:
        return []  # the servers' memory is not this process's to read

    def shutdown(self) -> None:
        """The servers are not ours to stop; a Ray placement of the training ranks is."""
        if self.placement is not None:
            self.placement.remove()
            self.placement = None


def _int_version(raw: Any, default: int) -> int:
    """SGLang reports weight_version as a string ("default" until the first update)."""
    try:
        return int(raw)
    except (TypeError, ValueError):
        return default
