"""The controller as a process of its own, with its northbound ingress (Fig. 1: the
configuration requests that become Table I messages).

``python -m delivery.controller_host --spec spec.json [--ready file]`` starts a
:class:`~delivery.controller.Controller` (which recovers its channels, topic mapping,
subscriptions and unconfirmed outbox from the metadata store) and serves the
``ControllerIngress`` gRPC service of ``delivery/protos/smart_delivery.proto`` on a fixed
port. The spec (written by :func:`controller_spec`) holds the ``ControllerConfig`` mapping
(with a fixed ``reply_port``, so agents find a restarted controller), the agents' addresses
and the ingress address. SIGTERM closes it cleanly; SIGKILL is a crash, after which the same
command with the same spec carries on.

``Configure`` is the durable acknowledgement of Section VI: every request of a call is
checked first (a bad one refuses the whole call with ``INVALID_ARGUMENT`` naming the request
index and the field, and nothing of it is stored); then the requests are stamped with
generation timestamps and stored in the controller's outbox in one transaction
(``Controller.send_many``) before ``Accepted`` is returned. What a crash interrupts before
that answer may or may not be stored: the client does not know, and an agent never applies a
message twice (Section VI-B), so sending such a request again is safe.

Security: the ingress uses the controller's ``security`` setting (the spec's
``controller.security`` block, secure by default): mutual TLS with the ``controller``
identity, and every method (``Configure``, ``SetChannels``, ``Status``) serves only
certificates of role ``admin``, the management plane's (:class:`delivery.rpc.RoleGuard`;
not ``controller``: no other controller, nor this one, has business calling it). Callers
connect with :func:`delivery.rpc.open_channel` as ``admin``. A refusal is
``PERMISSION_DENIED``, one warning line, and counts in the controller's ``refused_calls``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from envs.dsmd.message import Message, table1_problem
from security.tls import Security, server_credentials

from .controller import RPC, Controller, ControllerConfig
from .rpc import RoleGuard, pb, pb_grpc

__all__ = ["ControllerIngressServicer", "Ingress", "SpecError", "controller_spec",
           "load_spec", "main"]

log = logging.getLogger(__name__)

_SPEC_KEYS = {"controller", "agents", "ingress_host", "ingress_port"}

#: the roles whose certificates may call the ingress
INGRESS_ROLES = frozenset({"admin"})


class SpecError(ValueError):
    """A controller-host spec that cannot be used; the text names the key."""


class ControllerIngressServicer(pb_grpc.ControllerIngressServicer):
    """The ``ControllerIngress`` service on a running :class:`Controller`."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        # stamping and storing in one order: a call's timestamps are all above those of the
        # calls accepted before it, so per resource the newer request is the newer message
        self._order = threading.Lock()
        # accepted RPC messages leave at the controller's next flush: a thread of its own
        # flushes after every accepted call (calls accepted meanwhile go in one flush)
        self._wake = threading.Event()
        self._closed = False
        self._flusher = threading.Thread(target=self._flush_loop, name="ingress-flush",
                                         daemon=True)
        self._flusher.start()

    def _flush_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            closed = self._closed
            try:
                self.controller.flush(wait=False)
            except Exception:  # the next accepted call tries again
                log.exception("flushing the controller")
            if closed:
                return

    def close(self) -> None:
        """Stop the flushing thread (after a last flush)."""
        self._closed = True
        self._wake.set()
        self._flusher.join(10)

    # ------------------------------------------------------------------ checks
    def _hosts_problem(self, hosts: Iterable[int]) -> str | None:
        seen: set[int] = set()
        for h in hosts:
            if h in seen:
                return f"node {h} is named twice"
            seen.add(h)
        unknown = sorted(seen - set(self.controller.agents))
        if unknown:
            known = sorted(self.controller.agents)
            have = (f"nodes {known}" if len(known) <= 16
                    else f"{len(known)} nodes, {known[0]}..{known[-1]}")
            return f"node(s) {unknown[:10]} unknown to this controller (it has {have})"
        return None

    def request_problem(self, requests: Sequence[Any]) -> str | None:
        """The first bad field of a ``ConfigRequests`` call, as ``requests[i].field: what``,
        or None."""
        for i, r in enumerate(requests):
            problem = table1_problem(r.configuration_type, r.operation_type, r.hosts)
            if problem is not None:
                name = problem.split(" ", 1)[0]
                where = name if name in ("configuration_type", "operation_type") else "hosts"
                return f"requests[{i}].{where}: {problem}"
            problem = self._hosts_problem(r.hosts)
            if problem is not None:
                return f"requests[{i}].hosts: {problem}"
            if r.size_bytes <= 0:
                return f"requests[{i}].size_bytes: must be positive, got {r.size_bytes}"
        return None

    def channels_problem(self, types: Sequence[Any]) -> str | None:
        """The first bad field of a ``ChannelsRequest``, as ``types[i].field: what``, or
        None."""
        seen: set[int] = set()
        for i, tc in enumerate(types):
            if tc.type_id in seen:
                return f"types[{i}].type_id: type {tc.type_id} is named twice"
            seen.add(tc.type_id)
            if tc.hosts:
                problem = self._hosts_problem(tc.hosts)
                if problem is not None:
                    return f"types[{i}].hosts: {problem}"
            elif tc.type_id not in self.controller.hosts:
                return (f"types[{i}].hosts: type {tc.type_id} is new to this controller: "
                        f"name its destination nodes")
        return None

    # ------------------------------------------------------------------ the service
    def Configure(self, request: Any, context: Any) -> Any:
        problem = self.request_problem(request.requests)
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        ctl = self.controller
        with self._order:
            items = [(Message(r.message_id, r.request_id, r.vpc_id, r.configuration_type,
                              r.operation_type, r.resource_id, r.size_bytes, tuple(r.hosts),
                              ctl.timestamp()), int(r.type_id))
                     for r in request.requests]
            try:
                ctl.send_many(items)
            except Exception as e:
                log.exception("Configure: %d requests not accepted", len(items))
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"the controller could not store the requests ({e})")
        self._wake.set()
        return pb.Accepted(timestamps_ns=[m.timestamp_ns for m, _ in items],
                           message_ids=[m.message_id for m, _ in items])

    def SetChannels(self, request: Any, context: Any) -> Any:
        problem = self.channels_problem(request.types)
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        channels = {int(tc.type_id): int(tc.channel) for tc in request.types}
        hosts = {int(tc.type_id): tuple(int(h) for h in tc.hosts)
                 for tc in request.types if tc.hosts}
        try:
            changed = self.controller.set_channels(channels, hosts)
        except Exception as e:
            log.exception("SetChannels %s", channels)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the channel switch failed ({e})")
        return pb.ChannelsReply(types=changed["types"], subscribe=changed["subscribe"],
                                unsubscribe=changed["unsubscribe"],
                                deferred=changed.get("deferred", 0))

    def Status(self, request: Any, context: Any) -> Any:
        return pb.StatusReply(stats_json=json.dumps(self.stats()),
                              channels=dict(self.controller.channel))

    def stats(self) -> dict:
        """The controller's counters (read while its threads update them)."""
        for _ in range(10):
            try:
                return self.controller.stats.as_dict()
            except RuntimeError:  # a counter dict changed size while it was copied
                continue
        return self.controller.stats.as_dict()


class Ingress:
    """``ControllerIngress`` served on ``host:port`` (0: any free port; ``port`` says which
    once started). The port is not shared (no ``SO_REUSEPORT``): a second controller on it
    fails at :meth:`start` instead of taking half of the calls. Secured as the controller's
    ``cfg.security`` says (see the module docstring)."""

    def __init__(self, controller: Controller, host: str = "127.0.0.1", port: int = 0,
                 workers: int = 8) -> None:
        self.controller, self.host, self.port, self.workers = controller, host, port, workers
        self.servicer: ControllerIngressServicer | None = None
        self.server: grpc.Server | None = None
        self.guard: RoleGuard | None = None

    def start(self) -> Ingress:
        sec = self.controller.cfg.security
        insecure = sec.warn_if_insecure("controller ingress")
        interceptors = []
        if not insecure:
            self.guard = RoleGuard("controller ingress", INGRESS_ROLES,
                                   on_refuse=self.controller.count_refused)
            interceptors.append(self.guard)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.workers,
                                                        thread_name_prefix="ingress"),
                             options=[("grpc.so_reuseport", 0)], interceptors=interceptors)
        servicer = ControllerIngressServicer(self.controller)
        pb_grpc.add_ControllerIngressServicer_to_server(servicer, server)
        why = ""
        address = f"{self.host}:{self.port}"
        try:
            bound = (server.add_insecure_port(address) if insecure else server.add_secure_port(
                address, server_credentials(sec.identity("controller"))))
        except RuntimeError as e:
            bound, why = 0, f" ({e})"
        if not bound:
            servicer.close()
            raise OSError(f"controller ingress: cannot listen on {self.host}:{self.port}{why}")
        server.start()
        self.server, self.servicer, self.port = server, servicer, bound
        return self

    def stop(self, grace: float = 2.0) -> None:
        """Stop taking calls (those in progress get ``grace`` seconds), then flush."""
        if self.server is not None:
            self.server.stop(grace).wait()
        if self.servicer is not None:
            self.servicer.close()


def controller_spec(agents: Mapping[int, str], *, ingress_port: int,
                    ingress_host: str = "127.0.0.1", **config: Any) -> dict:
    """The JSON spec of a controller-host process: the ``ControllerConfig`` mapping
    (``config``: ``pulsar_url``, ``store_url``, a fixed ``reply_port``, ...), the agents
    (node id -> ``host:port``) and the ingress address. Checked here, so a bad spec fails
    where it is written."""
    config = dict(config)
    if isinstance(config.get("security"), Security):  # its mapping, for the JSON file
        config["security"] = dataclasses.asdict(config["security"])
    spec = {"controller": config, "agents": {str(n): str(a) for n, a in agents.items()},
            "ingress_host": ingress_host, "ingress_port": int(ingress_port)}
    load_spec(spec)
    return spec


def load_spec(spec: Mapping[str, Any]) -> tuple[ControllerConfig, dict[int, str], str, int]:
    """(controller config, agents, ingress host, ingress port) of a spec; :class:`SpecError`
    (or the config's own error) naming the key that is wrong."""
    unknown = sorted(set(spec) - _SPEC_KEYS)
    if unknown:
        raise SpecError(f"controller spec: unknown key(s) {unknown} (known: "
                        f"{sorted(_SPEC_KEYS)})")
    for key in ("controller", "agents", "ingress_port"):
        if key not in spec:
            raise SpecError(f"controller spec: {key} is missing")
    if not isinstance(spec["controller"], Mapping):
        raise SpecError("controller spec: controller must be a mapping (ControllerConfig)")
    cfg = ControllerConfig.from_mapping(spec["controller"])
    if not cfg.reply_port:
        raise SpecError("controller spec: controller.reply_port must be a fixed port (agents "
                        "report to it, also after a restart), got 0")
    if not isinstance(spec["agents"], Mapping) or not spec["agents"]:
        raise SpecError("controller spec: agents must map node ids to host:port")
    agents: dict[int, str] = {}
    for n, addr in spec["agents"].items():
        try:
            node = int(n)
        except ValueError:
            raise SpecError(f"controller spec: agents: {n!r} is not a node id") from None
        if not isinstance(addr, str) or ":" not in addr:
            raise SpecError(f"controller spec: agents.{n}: {addr!r} is not host:port")
        agents[node] = addr
    port = spec["ingress_port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise SpecError(f"controller spec: ingress_port must be a TCP port, got {port!r}")
    host = spec.get("ingress_host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise SpecError(f"controller spec: ingress_host must be a host name, got {host!r}")
    return cfg, agents, host, port


def recovered(ctl: Controller) -> dict:
    """What a started controller holds (after recovering from the store)."""
    stats = ctl.stats.as_dict()
    return {"types": len(ctl.channel),
            "mq_types": sum(1 for c in ctl.channel.values() if c != RPC),
            "subscriptions": sum(len(v) for v in ctl.node_topics.values()),
            "outbox_redelivered": stats.get("outbox_redelivered", 0),
            "outbox_corrupt": stats.get("outbox_corrupt", 0)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="run the SMART controller with its ingress "
                                             "(delivery.controller_host)")
    ap.add_argument("--spec", required=True, help="JSON spec written by controller_spec()")
    ap.add_argument("--ready", help="file written (ports and what was recovered, as JSON) "
                                    "once the ingress serves")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    log.setLevel(logging.INFO)
    try:
        cfg, agents, host, port = load_spec(json.loads(Path(args.spec).read_text()))
    except (OSError, ValueError) as e:
        ap.error(f"{args.spec}: {e}")
    ctl = Controller(cfg, agents).start()
    try:
        ingress = Ingress(ctl, host, port).start()
    except OSError:
        ctl.close()
        raise
    bound = ingress.port
    got = recovered(ctl)
    start_s = time.perf_counter() - t0
    log.info("controller serving after %.2f s: ingress %s:%d, replies on %s; recovered %d "
             "type channels (%d on topics), %d node subscriptions; %d unconfirmed outbox "
             "(message, node) pairs re-delivered, %d corrupt outbox rows refused", start_s,
             host, bound, ctl.reply_address, got["types"], got["mq_types"],
             got["subscriptions"], got["outbox_redelivered"], got["outbox_corrupt"])
    if args.ready:
        tmp = Path(args.ready + ".tmp")
        tmp.write_text(json.dumps({"ingress": bound, "reply": ctl.reply_port,
                                   "pid": os.getpid(), "start_s": round(start_s, 3),
                                   "recovered": got}))
        tmp.replace(args.ready)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    ingress.stop()
    ctl.close()


if __name__ == "__main__":
    main()
