#!/usr/bin/python3
"""Checks the deployment files without a Docker engine: the compose file and the Envoy and
Prometheus configs parse; every flag they pass to combs-server, combs-loadgen and combs is one
the binary's --help lists; ports and names agree across files; the Prometheus rules use metrics a
real combs-server exposes; the image builds with the commands CI runs.

usage: check_deploy.py SOURCE_DIR BIN_DIR
"""
import json
import re
import subprocess
import sys
import tempfile
import urllib.request

import yaml

src, bin_dir = sys.argv[1:3]
failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


def load(path):
    with open(f"{src}/{path}") as f:
        return f.read()


def flags_of(args):
    return [a for a in args if isinstance(a, str) and a.startswith("--")]


def help_flags(tool):
    out = subprocess.run([f"{bin_dir}/{tool}", "--help"], capture_output=True, text=True).stdout
    return set(re.findall(r"--[a-z][a-z0-9-]*", out))


compose = yaml.safe_load(load("deploy/docker-compose.yml"))
envoy = yaml.safe_load(load("deploy/envoy.yaml"))
prom = yaml.safe_load(load("deploy/prometheus/prometheus.yml"))
rules = yaml.safe_load(load("deploy/prometheus/rules.yml"))
dockerfile = load("Dockerfile")
check(all(isinstance(x, dict) for x in (compose, envoy, prom, rules)), "compose, envoy, prometheus and rules parse")

services = compose["services"]
server_flags, cli_help, loadgen_help = help_flags("combs-server"), help_flags("combs"), help_flags("combs-loadgen")
# The image's entrypoint and the compose commands: flags combs-server accepts.
entry = json.loads(re.search(r"ENTRYPOINT (\[.*?\])", dockerfile.replace("\\\n", " "), re.S).group(1))
check(entry[0] == "combs-server", "the image's entrypoint is combs-server")
for f in flags_of(entry):
    check(f in server_flags, f"Dockerfile ENTRYPOINT flag {f} is in combs-server --help")
servers = [n for n, s in services.items() if s.get("entrypoint") is None and "combs" in str(s.get("image", ""))]
check(set(servers) == {"combs", "combs-replica"}, f"combs-server services: {servers}")
for name in servers:
    for f in flags_of(services[name]["command"]):
        check(f in server_flags, f"{name}: flag {f} is in combs-server --help")
    hc = services[name]["healthcheck"]["test"]
    check(hc[1] == "combs" and "health" in hc, f"{name}: health check runs `combs ... health`")
    for f in flags_of(hc):
        check(f in cli_help or f == "--server", f"{name}: health check flag {f} is one combs takes")
    gpu = services[name]["deploy"]["resources"]["reservations"]["devices"][0]
    check(gpu["capabilities"] == ["gpu"], f"{name}: reserves the GPU")
    check(any(v.endswith(":/models:ro") for v in services[name]["volumes"]), f"{name}: models volume at /models")
    check(services[name]["restart"] == "unless-stopped", f"{name}: restart policy")
loadgen = services["loadgen"]
check(loadgen["entrypoint"] == ["combs-loadgen"] and "loadtest" in loadgen["profiles"], "loadgen profile runs combs-loadgen")
for f in flags_of(loadgen["command"]):
    check(f in loadgen_help, f"loadgen: flag {f} is in combs-loadgen --help")

# Ports: gRPC 50051 and metrics 9464 in the entrypoint, EXPOSE, compose, Envoy and Prometheus.
listen = entry[entry.index("--listen") + 1].rsplit(":", 1)[1]
metrics = entry[entry.index("--metrics-listen") + 1].rsplit(":", 1)[1]
expose = re.search(r"^EXPOSE (.*)$", dockerfile, re.M).group(1).split()
check(listen in expose and metrics in expose, f"EXPOSE {expose} has the gRPC ({listen}) and metrics ({metrics}) ports")
published = {p.split(":")[1] for p in services["combs"]["ports"]}
check(published == {listen, metrics}, f"combs publishes {published}")
cluster = envoy["static_resources"]["clusters"][0]
endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
check(str(endpoint["port_value"]) == listen, "Envoy sends to the replicas' gRPC port")
check(endpoint["address"] == "combs-replica", "Envoy's upstream is the combs-replica service")
check(cluster["lb_policy"] == "RING_HASH", "Envoy balances by ring hash")
check("http2_protocol_options" in json.dumps(cluster), "Envoy speaks HTTP/2 (gRPC) upstream")
check("grpc_health_check" in cluster["health_checks"][0], "Envoy health-checks replicas through grpc.health.v1")
listener_port = str(envoy["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"])
check(f"8080:{listener_port}" in services["envoy"]["ports"], "compose publishes Envoy's listener")
target = loadgen["command"][loadgen["command"].index("--server") + 1]
check(target.endswith(f"envoy:{listener_port}}}") or target.endswith(f"envoy:{listener_port}"),
      f"loadgen targets Envoy's listener ({target})")
hcm = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
hp = route["hash_policy"][0]["header"]
check(hp["header_name"] == "combs-session-id", "Envoy hashes on the combs-session-id metadata")
rx = re.compile(hp["regex_rewrite"]["pattern"]["regex"])
parent, child = "0123456789abcdef" + "1" * 16, "0123456789abcdef" + "2" * 16
check(rx.sub(r"\1", parent) == rx.sub(r"\1", child) == "0123456789abcdef",
      "a session and its fork hash alike (the family prefix)")
for path in ("src/tools/combs_loadgen/flows.cc", "src/tools/combs_cli/main.cc", "proto/combs/v1/combs.proto"):
    check('combs-session-id' in load(path), f"{path} knows the combs-session-id metadata")
jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
check(jobs["combs"]["static_configs"][0]["targets"] == [f"combs:{metrics}"], "Prometheus scrapes combs's metrics port")
dns = jobs["combs-replicas"]["dns_sd_configs"][0]
check(dns["names"] == ["combs-replica"] and str(dns["port"]) == metrics, "Prometheus scrapes every replica by DNS")
check(any("prometheus.yml" in v or "/etc/prometheus" in v for v in services["prometheus"]["volumes"]),
      "compose mounts the Prometheus config")

# Compose itself validates the file, where it is installed (Debian's docker-compose 1.29 needs no
# Docker engine for `config`), for the default services and with every profile.
import shutil  # noqa: E402

compose_cmd = ["docker-compose"] if shutil.which("docker-compose") else None
if compose_cmd:
    for profiles in ([], ["--profile", "replicas", "--profile", "loadtest"]):
        r = subprocess.run(compose_cmd + ["-f", f"{src}/deploy/docker-compose.yml"] + profiles + ["config", "-q"],
                           capture_output=True, text=True)
        check(r.returncode == 0, f"docker-compose config {' '.join(profiles) or '(default)'}: {r.stderr.strip()[:200]}")
else:
    print("skip  docker-compose is not installed: compose did not validate the file")

# The rules use metrics a real server exposes.
with tempfile.TemporaryDirectory() as tmp:
    server = subprocess.Popen([f"{bin_dir}/combs-server", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                               "--cache-dir", tmp, "--kv-memory-mib", "16", "--threads", "1", "--vocab", ""],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = None
        for line in server.stdout:
            if "metrics on " in line:
                url = line.split("metrics on ", 1)[1].strip()
            if " serving " in line:
                break
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        exposed = set(re.findall(r"^# TYPE ([a-z_:]+) ", text, re.M)) | set(re.findall(r"^([a-z_:]+)", text, re.M))
        exposed |= {f"{n}_{s}" for n in exposed for s in ("bucket", "sum", "count")}
    finally:
        server.terminate()
        server.wait(timeout=30)
for group in rules["groups"]:
    for rule in group["rules"]:
        for name in set(re.findall(r"\b(combs_[a-z_]+)", rule["expr"])):
            check(name in exposed, f"rule {rule['record']}: {name} is exposed by combs-server")

# The image builds the way CI does.
ci = load(".ci/run")
presets = json.loads(load("CMakePresets.json"))
check("RUN .ci/install-deps" in dockerfile, "the image installs with .ci/install-deps, as CI does")
check("cmake --workflow --preset image" in dockerfile and "cmake --workflow --preset image" in ci,
      "the image's build command (cmake --workflow --preset image) is one CI runs")
check(any(w["name"] == "image" for w in presets["workflowPresets"]), "the image workflow preset exists")
check("nvidia/cuda:13" in dockerfile and "debian:12" in dockerfile, "CUDA 13 and Debian 12 variants")
check(re.search(r"^USER combs$", dockerfile, re.M) is not None, "the image runs as a non-root user")
check("HEALTHCHECK" in dockerfile, "the image has a health check")

print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
