"""Rollout episodes as Kubernetes Jobs (`--backend k8s`): the manifests as plain dicts, written as YAML for
`--dry-run DIR`, and `submit`, which creates them with the official client, watches the Jobs, collects
each pod's log and result, and deletes what it created. docs/rollouts-k8s.md describes the objects.

Per episode a ConfigMap (the pod's copy of the episode spec, task files included, plus non-secret env) and
a Job running `python -m openforge.rollout.episode /spec/spec.json` as root, which starts the agent as an
unprivileged uid (sandbox "uid"), so the spec, mounted root-only, stays out of the agent's reach; per run one
NetworkPolicy letting the pods reach only the proxy (and DNS). Tokens only ever appear as `secretKeyRef`s to
Secrets made by the user.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, TypeVar

import yaml

from openforge.rollout.adapters import SECRET_NAME
from openforge.rollout.failures import EpisodeStatus
from openforge.rollout.spec import (
    CLIENT_TOKEN_ENV,
    RESULT_MARKER,
    REWARD_TOKEN_ENV,
    TIMEOUTS_PER_EPISODE,
    EpisodeResult,
    EpisodeSpec,
)

# Where the pod finds things: the ConfigMap is mounted at SPEC_DIR, the episode's scratch (an emptyDir) at
# EPISODE_DIR; the spec in the ConfigMap names these paths, not the runner's local ones.
SPEC_DIR = "/spec"
SPEC_KEY = "spec.json"
EPISODE_DIR = "/episode"
POD_WORKDIR = f"{EPISODE_DIR}/workdir"
POD_HOME = f"{EPISODE_DIR}/home"
POD_OUT = f"{EPISODE_DIR}/out"
CONTAINER = "episode"
COMMAND = ["python", "-m", "openforge.rollout.episode", f"{SPEC_DIR}/{SPEC_KEY}"]
LABEL_PREFIX = "openforge/"
CONFIGMAP_MAX_BYTES = 1024 * 1024  # the API server refuses a larger ConfigMap
POD_OVERHEAD = 256 * 2**20  # memory of the episode process (Python) beside the agent's limit
SCRATCH_MARGIN = 64 * 2**20  # ephemeral storage beside the workspaces and output: logs, spec, result
INT32_MAX = 2**31 - 1  # ttlSecondsAfterFinished, ports, modes are int32 in the API
INT64_MAX = 2**63 - 1  # activeDeadlineSeconds; a quantity's value (cpu: in millicores)
SPEC_MODE = 0o400  # the spec file: root's only (the agent runs as another uid)
# What the episode process (root) needs to run the agent as another uid and clean up after it: change
# ownership of the workspace (CHOWN), switch uid, gid and groups (SETUID, SETGID), signal the agent's
# processes (KILL), read and remove what the agent wrote whatever its modes (DAC_OVERRIDE). The agent, once
# its uid is not 0, holds none of them (and no-new-privileges keeps it so).
CAPABILITIES = ["CHOWN", "DAC_OVERRIDE", "KILL", "SETGID", "SETUID"]
# An emptyDir is mode 0777 without the sticky bit: the init container makes /episode root's (the agent owns
# only the workdir and home the entrypoint gives it) and /tmp sticky (no one removes another's files).
VOLUME_MODES = ["sh", "-c", f"chmod 0755 {EPISODE_DIR} && chmod 1777 /tmp"]

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_SUFFIX: dict[str, Decimal | int] = {
    "": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}


class K8sOptionsError(ValueError):
    """An option or a spec that cannot become a valid manifest; the message is one sentence for the user."""


@dataclass(frozen=True)
class K8sOptions:
    """What the manifests need beyond the episode specs. The proxy is named as Kubernetes names it for a
    NetworkPolicy, by its pods' labels (in `proxy_namespace`, default the episodes' own) or by an IP block,
    since a policy cannot name a host; `proxy_port` is the port its pods listen on."""

    image: str
    client_token_secret: str  # Secret holding the agents' proxy key (the proxy's client token)
    reward_token_secret: str  # Secret holding the verifier's reward token
    proxy_port: int
    proxy_pod_labels: dict[str, str] = field(default_factory=dict)
    proxy_namespace: str | None = None
    proxy_cidr: str | None = None
    namespace: str = "default"
    client_token_key: str = "token"
    reward_token_key: str = "token"
    labels: dict[str, str] = field(default_factory=dict)  # added to every object (and pod) of the run
    env: dict[str, str] = field(default_factory=dict)  # non-secret container env, through the ConfigMap
    cpu_request: str = "1"
    cpu_limit: str = "2"
    memory_request: str = "2Gi"
    memory_limit: str = "4Gi"
    ttl_seconds_after_finished: int = 3600
    deadline_margin_s: int = 300  # beyond 3 x the task's timeout (setup, agent, verifier): image pull, post
    allow_dns: bool = True


def load_options(path: Path) -> K8sOptions:
    """The cluster settings of `--k8s-config FILE.toml`: K8sOptions' fields as top-level keys
    (docs/rollouts-k8s.md), checked as `check_options` does; K8sOptionsError names the file and the key."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise K8sOptionsError(f"cannot read {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise K8sOptionsError(f"{path} is not TOML: {e}") from None
    known = {f.name: f for f in fields(K8sOptions)}
    for key, value in data.items():
        if key not in known:
            raise K8sOptionsError(f"{path}: unknown key {key!r} (known: {', '.join(known)})")
        kind = str(known[key].type)
        ok = (isinstance(value, dict) and all(isinstance(v, str) for v in value.values()) if kind.startswith("dict")
              else isinstance(value, bool) if kind == "bool"
              else isinstance(value, int) and not isinstance(value, bool) if kind == "int"
              else isinstance(value, str))
        if not ok:
            raise K8sOptionsError(f"{path}: {key} must be {'a table of strings' if kind.startswith('dict') else kind}")
    missing = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING and n not in data]
    if missing:
        raise K8sOptionsError(f"{path}: missing {', '.join(missing)}")
    options = K8sOptions(**data)
    check_options(options)
    return options


# -- names and checks ----------------------------------------------------------------------------------------
def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def object_name(prefix: str, text: str) -> str:
    """A DNS-1123 label (<= 63 characters, also fit for a Job's pods) from any text, made unique by a hash
    of the text, so episodes whose ids differ only in case or punctuation never share a name."""
    clean = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[: 62 - len(prefix) - 9].strip("-")
    return f"{prefix}-{clean}-{_digest(text)}" if clean else f"{prefix}-{_digest(text)}"


def label_value(text: str) -> str:
    """`text` when it is a valid label value, else a cleaned, shortened form ending in a hash of it (the
    full value is kept in an annotation)."""
    if len(text) <= 63 and _LABEL_VALUE.fullmatch(text):
        return text
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:54].strip("-_.")
    return f"{clean}-{_digest(text)}" if clean else _digest(text)


def _quantity(name: str, text: str, unit: Decimal | int = 1) -> Decimal:
    """The quantity's value; refused past the int64 of `unit`s the API server stores (cpu: millicores)."""
    match = _QUANTITY.fullmatch(text)
    if not match:
        raise K8sOptionsError(f"{name} {text!r} is not a Kubernetes quantity (e.g. 500m, 2, 512Mi, 4Gi)")
    try:
        value = Decimal(match.group(1)) * _SUFFIX[match.group(2) or ""]
    except InvalidOperation:
        raise K8sOptionsError(f"{name} {text!r} is not a Kubernetes quantity") from None
    if value / unit > INT64_MAX:
        raise K8sOptionsError(f"{name} {text} is past what the API server stores ({INT64_MAX} "
                              f"{'millicores' if unit != 1 else 'bytes'})")
    return value


def _check_labels(what: str, labels: dict[str, str]) -> None:
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix))) or len(name) > 63 \
                or not _LABEL_NAME.fullmatch(name):
            raise K8sOptionsError(f"{what}: {key!r} is not a valid label key ([prefix/]name, name <= 63 "
                                  "characters of letters, digits, '-', '_', '.')")
        if key.startswith(LABEL_PREFIX):
            raise K8sOptionsError(f"{what}: {key!r} uses the {LABEL_PREFIX} prefix, which OpenForge sets itself")
        if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            raise K8sOptionsError(f"{what}: {key}={value!r} is not a valid label value (<= 63 characters of "
                                  "letters, digits, '-', '_', '.', starting and ending with a letter or digit)")


def check_options(options: K8sOptions) -> None:
    """Raise K8sOptionsError naming the first option that cannot make a valid manifest."""
    if not options.image.strip() or any(c.isspace() for c in options.image):
        raise K8sOptionsError(f"image {options.image!r} is not an image reference")
    for what, name in (("namespace", options.namespace), ("proxy namespace", options.proxy_namespace)):
        if name is not None and (len(name) > 63 or not _DNS_LABEL.fullmatch(name)):
            raise K8sOptionsError(f"{what} {name!r} is not a valid namespace name (lowercase letters, digits, '-')")
    for what, name, key in (("client token", options.client_token_secret, options.client_token_key),
                            ("reward token", options.reward_token_secret, options.reward_token_key)):
        if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
            raise K8sOptionsError(f"{what} Secret name {name!r} is not a valid Secret name")
        if len(key) > 253 or not re.fullmatch(r"[-._a-zA-Z0-9]+", key):
            raise K8sOptionsError(f"{what} Secret key {key!r} is not a valid Secret key")
    if (options.client_token_secret, options.client_token_key) == (options.reward_token_secret,
                                                                   options.reward_token_key):
        raise K8sOptionsError("the client token and the reward token name the same Secret key; the agent "
                              "would hold the reward token (the proxy also refuses a token that is both)")
    if not 1 <= options.proxy_port <= 65535:
        raise K8sOptionsError(f"proxy port {options.proxy_port} is not between 1 and 65535")
    if bool(options.proxy_pod_labels) == bool(options.proxy_cidr):
        raise K8sOptionsError("give the proxy's pod labels or its IP block (CIDR), exactly one: the "
                              "NetworkPolicy allows egress only there")
    if options.proxy_cidr:
        try:
            ipaddress.ip_network(options.proxy_cidr)
        except ValueError:
            raise K8sOptionsError(f"proxy CIDR {options.proxy_cidr!r} is not an IP block (e.g. 10.0.3.7/32)") \
                from None
    _check_labels("proxy pod labels", options.proxy_pod_labels)
    _check_labels("labels", options.labels)
    for name in options.env:
        if not _ENV_NAME.fullmatch(name):
            raise K8sOptionsError(f"env name {name!r} is not a variable name")
        if SECRET_NAME.fullmatch(name):
            raise K8sOptionsError(f"env {name} looks like a secret: a plain env value is readable in the ConfigMap "
                                  "by anyone who can read the namespace; it belongs in a Secret")
    for resource, unit in (("cpu", Decimal("0.001")), ("memory", 1)):
        request = _quantity(f"{resource} request", getattr(options, f"{resource}_request"), unit)
        limit = _quantity(f"{resource} limit", getattr(options, f"{resource}_limit"), unit)
        if request > limit:
            raise K8sOptionsError(f"{resource} request {getattr(options, f'{resource}_request')} is above its "
                                  f"limit {getattr(options, f'{resource}_limit')}")
    for what, value, most in (("ttlSecondsAfterFinished", options.ttl_seconds_after_finished, INT32_MAX),
                              ("deadline margin", options.deadline_margin_s, INT64_MAX)):
        if value < 0:
            raise K8sOptionsError(f"{what} {value} is negative")
        if value > most:
            raise K8sOptionsError(f"{what} {value} is past {most}, the largest the API server takes")


def check_specs(specs: Sequence[EpisodeSpec]) -> None:
    """One run (one NetworkPolicy selects its pods), each episode once."""
    if not specs:
        raise K8sOptionsError("no episodes to run")
    runs = {s.run_id for s in specs}
    if len(runs) > 1:
        raise K8sOptionsError(f"episodes of {len(runs)} runs ({', '.join(sorted(runs))}); one run at a time")
    seen: set[str] = set()
    for s in specs:
        if s.episode in seen:
            raise K8sOptionsError(f"episode {s.episode!r} appears twice")
        seen.add(s.episode)
        if not math.isfinite(s.task.timeout_s) or s.task.timeout_s <= 0:
            raise K8sOptionsError(f"task {s.task.id!r}: timeout_s {s.task.timeout_s} is not a positive number")


# -- manifests -----------------------------------------------------------------------------------------------
def run_labels(run_id: str, options: K8sOptions) -> dict[str, str]:
    return {**options.labels, "app.kubernetes.io/name": "openforge", "app.kubernetes.io/component": "rollout",
            f"{LABEL_PREFIX}run": label_value(run_id)}


def episode_labels(spec: EpisodeSpec, options: K8sOptions) -> dict[str, str]:
    return {**run_labels(spec.run_id, options), f"{LABEL_PREFIX}task": label_value(spec.task.id),
            f"{LABEL_PREFIX}toolchain": label_value(spec.adapter.name), f"{LABEL_PREFIX}attempt": str(spec.attempt)}


def pod_spec(spec: EpisodeSpec) -> EpisodeSpec:
    """The spec as the pod reads it: its workspace, home and output in the pod's scratch volume, and the
    agent run as an unprivileged uid by the root episode process (one episode per pod)."""
    return replace(spec, workdir=POD_WORKDIR, home=POD_HOME, out_dir=POD_OUT, sandbox="uid", pristine_dir="")


def deadline_s(spec: EpisodeSpec, options: K8sOptions) -> int:
    """The Job's activeDeadlineSeconds: the entrypoint bounds setup, agent and verifier (and the pristine
    task's setup and verifier, pristine.py) each by the task's timeout and reports `timeout` itself, so the
    deadline is that many timeouts plus a margin (image pull, reward post), the last resort when the pod hangs."""
    return TIMEOUTS_PER_EPISODE * math.ceil(spec.task.timeout_s) + options.deadline_margin_s


def _bytes(n: int) -> str:
    return f"{n // 2**20}Mi" if n % 2**20 == 0 else str(n)


def _least(resource: str, a: str, b: str) -> str:
    unit: Decimal | int = Decimal("0.001") if resource == "cpu" else 1
    return a if _quantity(resource, a, unit) <= _quantity(resource, b, unit) else b


def pod_resources(spec: EpisodeSpec, options: K8sOptions) -> dict[str, dict[str, str]]:
    """The container's requests and limits: the episode's limits where it sets them (memory: plus the episode
    process's own; ephemeral-storage from disk: the workspace, its verifier's copy and the kept output), the
    options' for the rest; a request is never above its limit."""
    lim = spec.limits
    limits = {"cpu": f"{math.ceil(lim.cpus * 1000)}m" if lim.cpus else options.cpu_limit,
              "memory": _bytes(lim.memory + POD_OVERHEAD) if lim.memory else options.memory_limit}
    requests = {"cpu": _least("cpu", options.cpu_request, limits["cpu"]),
                "memory": _least("memory", options.memory_request, limits["memory"])}
    if lim.disk:
        limits["ephemeral-storage"] = requests["ephemeral-storage"] = _bytes(2 * lim.disk + 3 * lim.output +
                                                                             SCRATCH_MARGIN)
    return {"requests": requests, "limits": limits}


def configmap(spec: EpisodeSpec, options: K8sOptions) -> dict[str, Any]:
    data = {SPEC_KEY: pod_spec(spec).to_json(), "PYTHONUNBUFFERED": "1", **options.env}
    size = sum(len(k.encode()) + len(v.encode()) for k, v in data.items())
    if size > CONFIGMAP_MAX_BYTES:
        raise K8sOptionsError(f"episode {spec.episode!r}: its spec and env are {size} bytes, over a ConfigMap's "
                              "1 MiB; keep large task files in the image and copy them in `setup`")
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": object_name("of", spec.episode), "namespace": options.namespace,
                         "labels": episode_labels(spec, options)},
            "data": data}


def job(spec: EpisodeSpec, options: K8sOptions) -> dict[str, Any]:
    """The episode's Job: the entrypoint as root with CAPABILITIES only, the spec a root-only file."""
    name = object_name("of", spec.episode)
    labels = episode_labels(spec, options)
    env: list[dict[str, Any]] = [{"name": key, "valueFrom": {"configMapKeyRef": {"name": name, "key": key}}}
                                 for key in ("PYTHONUNBUFFERED", *options.env)]
    env += [{"name": CLIENT_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
                "name": options.client_token_secret, "key": options.client_token_key}}},
            {"name": REWARD_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
                "name": options.reward_token_secret, "key": options.reward_token_key}}}]
    resources = pod_resources(spec, options)
    scratch = [{"name": "episode", "mountPath": EPISODE_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    container = {
        "name": CONTAINER, "image": options.image, "imagePullPolicy": "IfNotPresent", "command": COMMAND,
        "workingDir": EPISODE_DIR, "env": env, "resources": resources,
        "volumeMounts": [{"name": "spec", "mountPath": SPEC_DIR, "readOnly": True}, *scratch],
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"], "add": CAPABILITIES}},
    }
    volume_modes = {
        "name": "volumes", "image": options.image, "imagePullPolicy": "IfNotPresent", "command": VOLUME_MODES,
        "resources": resources, "volumeMounts": scratch,
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
    }
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": options.namespace, "labels": labels,
                     "annotations": {f"{LABEL_PREFIX}episode": spec.episode, f"{LABEL_PREFIX}task-id": spec.task.id}},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": deadline_s(spec, options),
            "ttlSecondsAfterFinished": options.ttl_seconds_after_finished,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,  # the agent gets no Kubernetes API credential
                    "enableServiceLinks": False,  # nor other Services' addresses in its env
                    # no fsGroup: it would make the spec group-readable whatever its mode
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "initContainers": [volume_modes],
                    "containers": [container],
                    "volumes": [{"name": "spec", "configMap": {"name": name, "defaultMode": SPEC_MODE,
                                                               "items": [{"key": SPEC_KEY, "path": SPEC_KEY}]}},
                                {"name": "episode", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }


def network_policy(run_id: str, options: K8sOptions) -> dict[str, Any]:
    """Egress from the run's pods only to the proxy's port (and cluster DNS); no ingress at all."""
    if options.proxy_cidr:
        peer: dict[str, Any] = {"ipBlock": {"cidr": options.proxy_cidr}}
    else:
        peer = {"podSelector": {"matchLabels": dict(options.proxy_pod_labels)}}
        if options.proxy_namespace and options.proxy_namespace != options.namespace:
            peer["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": options.proxy_namespace}}
    egress: list[dict[str, Any]] = [{"to": [peer], "ports": [{"protocol": "TCP", "port": options.proxy_port}]}]
    if options.allow_dns:
        egress.append({"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                               "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
                       "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": object_name("of-run", run_id), "namespace": options.namespace,
                         "labels": run_labels(run_id, options)},
            "spec": {"podSelector": {"matchLabels": {f"{LABEL_PREFIX}run": label_value(run_id)}},
                     "policyTypes": ["Ingress", "Egress"], "ingress": [], "egress": egress}}


@dataclass(frozen=True)
class Manifests:
    """Everything one run creates: the NetworkPolicy, and per episode its spec, ConfigMap and Job."""

    policy: dict[str, Any]
    episodes: list[tuple[EpisodeSpec, dict[str, Any], dict[str, Any]]]


def build(specs: Sequence[EpisodeSpec], options: K8sOptions) -> Manifests:
    check_options(options)
    check_specs(specs)
    for s in specs:
        if deadline_s(s, options) > INT64_MAX:
            raise K8sOptionsError(f"task {s.task.id!r}: activeDeadlineSeconds {deadline_s(s, options)} is past "
                                  f"{INT64_MAX}, the largest the API server takes (timeout_s {s.task.timeout_s:g})")
    return Manifests(network_policy(specs[0].run_id, options),
                     [(s, configmap(s, options), job(s, options)) for s in specs])


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the spec JSON) as `|` blocks, so a dry-run's files read like hand-written ones."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s
                                                             else None))


def write_manifests(specs: Sequence[EpisodeSpec], options: K8sOptions, out: Path) -> list[Path]:
    """`--backend k8s --dry-run DIR`: `<job name>.yaml` per episode (its ConfigMap, then its Job) and
    `networkpolicy.yaml`; `kubectl apply -f DIR` would start the run. Returns the files written."""
    manifests = build(specs, options)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "networkpolicy.yaml"]
    written[0].write_text(yaml.dump(manifests.policy, Dumper=_Dumper, sort_keys=False))
    for _, cm, jb in manifests.episodes:
        path = out / f"{jb['metadata']['name']}.yaml"
        path.write_text(yaml.dump_all([cm, jb], Dumper=_Dumper, sort_keys=False))
        written.append(path)
    return written


# -- results from a pod's log --------------------------------------------------------------------------------
def result_from_log(log: str) -> EpisodeResult | None:
    """The entrypoint's result from its pod log: the last `OPENFORGE_RESULT {json}` line, else a last line
    that is itself the result's JSON object; None when neither (the pod died before writing one)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    marked = [line[len(RESULT_MARKER):] for line in lines if line.startswith(RESULT_MARKER)]
    for payload in ([marked[-1]] if marked else []) + lines[-1:]:
        try:
            return EpisodeResult(**json.loads(payload))
        except (ValueError, TypeError):
            continue
    return None


# -- a cluster -----------------------------------------------------------------------------------------------
def _finished(job_obj: Any) -> tuple[bool, str, bool]:
    """(done, reason, deadline exceeded) from a Job's conditions."""
    for cond in job_obj.status.conditions or []:
        if cond.status == "True" and cond.type in ("Complete", "Failed"):
            return True, f"{cond.type}: {cond.reason or ''} {cond.message or ''}".strip(), \
                cond.reason == "DeadlineExceeded"
    return False, "", False


_Model = TypeVar("_Model")


def _model(from_dict: Callable[[dict[str, Any]], _Model | None], manifest: dict[str, Any]) -> _Model:
    """A manifest as the client's model object (`from_dict` answers None only for None)."""
    obj = from_dict(manifest)
    assert obj is not None
    return obj


def submit(specs: Sequence[EpisodeSpec], options: K8sOptions, *, concurrency: int = 16,
           context: str | None = None,
           on_done: Callable[[EpisodeResult], None] = lambda r: None) -> list[EpisodeResult]:
    """Run the episodes as Jobs, at most `concurrency` at once, and return their results in spec order.
    Each episode's pod log goes to `<out_dir>/pod.log` and its result to `<out_dir>/result.json`.
    Everything created is deleted at the end, also on error or Ctrl-C (the Jobs' TTL is the fallback).

    NOT RUN: no cluster was reachable where this was written; only the manifests it creates are tested
    (schema-validated, and their command and env run locally). See docs/rollouts-k8s.md.
    """
    from kubernetes import client, config, watch  # the `k8s` extra; imported only to talk to a cluster

    manifests = build(specs, options)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(context=context)
    api = client.ApiClient()
    core, batch, net = client.CoreV1Api(api), client.BatchV1Api(api), client.NetworkingV1Api(api)
    ns = options.namespace
    pending = list(manifests.episodes)
    running: dict[str, EpisodeSpec] = {}
    results: dict[str, EpisodeResult] = {}

    def start(spec: EpisodeSpec, cm: dict[str, Any], jb: dict[str, Any]) -> None:
        core.create_namespaced_config_map(ns, _model(client.V1ConfigMap.from_dict, cm))
        created = batch.create_namespaced_job(ns, _model(client.V1Job.from_dict, jb)).metadata
        assert created is not None  # the API server answers with the Job it created, its name and uid set
        # the ConfigMap goes with its Job when the Job's TTL deletes it
        core.patch_namespaced_config_map(cm["metadata"]["name"], ns, {"metadata": {"ownerReferences": [{
            "apiVersion": "batch/v1", "kind": "Job", "name": created.name, "uid": created.uid}]}})
        running[jb["metadata"]["name"]] = spec

    def collect(name: str, reason: str, timeout: bool) -> None:
        spec = running.pop(name)
        pods = core.list_namespaced_pod(ns, label_selector=f"job-name={name}").items
        pod = pods[0].metadata if pods else None
        log = core.read_namespaced_pod_log(pod.name, ns, container=CONTAINER) if pod and pod.name else ""
        out = Path(spec.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pod.log").write_text(log)
        result = result_from_log(log) or EpisodeResult.unrewarded(
            spec, EpisodeStatus.TIMEOUT if timeout else EpisodeStatus.CRASHED, reason or "the pod printed no result")
        (out / "result.json").write_text(json.dumps(asdict(result), indent=1))
        results[spec.episode] = result
        on_done(result)
        delete(name)

    def delete(name: str) -> None:
        for call in (batch.delete_namespaced_job, core.delete_namespaced_config_map):
            try:
                call(name, ns, propagation_policy="Background")
            except client.ApiException as e:
                if e.status != 404:
                    raise

    net.create_namespaced_network_policy(ns, _model(client.V1NetworkPolicy.from_dict, manifests.policy))
    try:
        while pending or running:
            while pending and len(running) < concurrency:
                start(*pending.pop(0))
            stream = watch.Watch()
            for event in stream.stream(batch.list_namespaced_job, ns, timeout_seconds=60,
                                       label_selector=f"{LABEL_PREFIX}run={label_value(specs[0].run_id)}"):
                name = event["object"].metadata.name
                done, reason, timeout = _finished(event["object"])
                if name in running and done:
                    collect(name, reason, timeout)
                    stream.stop()
    finally:
        for name in list(running):
            delete(name)
        net.delete_namespaced_network_policy(manifests.policy["metadata"]["name"], ns)
    return [results[s.episode] for s in specs]

