"""A fresh controller process (plaintext or mutual TLS) and simulated fleet for one step of
bench/controller_scale.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import grpc
import psutil

from bench.prometheus_scraper import PrometheusScraper
from bench.scale_cores import CoreOfItsOwn, controller_cpus, pinning, place_self
from bench.scale_fleet import ENGINES_PER_NODE, Fleet, make_pki
from controller.rules.deployment_checks import MAX_ENGINES_PER_DEPLOYMENT
from motor.ports import free_port
from motor.service.grpc_server import TlsFiles, channel_credentials
from motor.v1 import controller_pb2_grpc


class Cluster:
    """A fresh controller process (plaintext or mutual TLS) and fleet for one trial; a context manager."""

    def __init__(self, args, tls: bool, cores: str = "shared", loop: str = "uvloop"):
        self.args, self.tls, self.cores = args, tls, cores
        place_self(cores)  # this script's threads, the scraper and the fleet: off the controller's core
        self.work = tempfile.mkdtemp(prefix="motor-scale-")
        port, self.metrics_port = free_port(), free_port()
        pki = make_pki(self.work) if tls else None
        command = [
            os.path.join(os.path.dirname(sys.executable), "motor-controller"),
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            os.path.join(self.work, "controller.db"),
            "--heartbeat-interval",
            "1",
            "--node-grace",
            str(args.node_grace),
            "--recheck-timeout",
            "1",
            "--max-heartbeats-per-second",
            str(args.max_heartbeats_per_second),
            "--metrics-port",
            str(self.metrics_port),
            "--log-level",
            "WARNING",
            "--event-loop",
            loop,
            # Plaintext callers are counted per host: every simulated node's stream comes from 127.0.0.1.
            "--max-streams-per-caller",
            str(2 * max(args.steps) + 100),
            # Past 12,500 nodes the fleet's engines exceed the default limit (100,000 a deployment).
            "--max-engines-per-deployment",
            str(max(MAX_ENGINES_PER_DEPLOYMENT, ENGINES_PER_NODE * max(args.steps))),
        ]
        if pki:
            command += [
                "--tls-cert",
                os.path.join(pki, "controller.crt"),
                "--tls-key",
                os.path.join(pki, "controller.key"),
                "--tls-ca",
                os.path.join(pki, "ca.crt"),
            ]
        self.command = command
        self.log = open(os.path.join(self.work, "controller.log"), "wb")
        self.controller = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pinning(cores)
        )
        self.proc = psutil.Process(self.controller.pid)
        own = controller_cpus(cores)
        self.isolation = CoreOfItsOwn(min(own), self.controller.pid).__enter__() if own else None
        options = [("grpc.max_receive_message_length", 256 << 20)]
        if pki:
            credentials = channel_credentials(
                TlsFiles(
                    cert=os.path.join(pki, "operator.crt"),
                    key=os.path.join(pki, "operator.key"),
                    ca=os.path.join(pki, "ca.crt"),
                )
            )
            self.channel = grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
        self.stub = controller_pb2_grpc.ControllerServiceStub(self.channel)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.scraper = PrometheusScraper(
            self.metrics_port, args.scrape_interval
        )  # from the start, as a Prometheus would
        self.scraper.start()
        self.fleet = Fleet(f"127.0.0.1:{port}", args, pki)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.scraper.stop()
        self.fleet.stop()
        self.channel.close()
        os.killpg(self.controller.pid, signal.SIGTERM)
        try:
            self.controller.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.controller.pid, signal.SIGKILL)
        self.log.close()
        if self.isolation is not None:
            self.isolation.__exit__()
        if self.args.keep:
            print(f"controller log and database kept in {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)
