"""Settings towards etcd, Redis and Kafka: TLS files checked before start-up, credentials and
TLS mapped onto each client's own options, and half-given settings refused."""

from __future__ import annotations

import datetime as dt

import pytest
from pydantic import ValidationError

from services.cli import certs
from services.cli.kafka_tls import SecureKafkaBroker
from services.cli.localservers import BackingSecurity
from services.cli.mesh import Mesh, MeshSpec
from services.common.config import BackingTLSConfig, EtcdConfig, KafkaConfig, RedisConfig
from services.common.tls.backing import check_backing_tls
from services.common.tls.material import TLSCertExpired, TLSFileMissing, TLSKeyMismatch, TLSNotPEM


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory):
    return certs.init_certs(tmp_path_factory.mktemp("certs"), roles=("router", "worker"))


def backing(directory, role="router", **changes) -> BackingTLSConfig:
    fields = dict(
        enabled=True,
        ca_file=str(directory / certs.CA_CERT),
        cert_file=str(certs.cert_path(directory, role)),
        key_file=str(certs.key_path(directory, role)),
    )
    fields.update(changes)
    return BackingTLSConfig(**fields)


def test_good_files_pass_and_off_checks_nothing(cert_dir):
    check_backing_tls(backing(cert_dir), "etcd.tls")
    check_backing_tls(BackingTLSConfig(ca_file="/absent"), "etcd.tls")
    # Server verification only, no client certificate: also fine.
    check_backing_tls(backing(cert_dir, cert_file="", key_file=""), "redis.tls")


def test_a_missing_file_names_its_field(cert_dir, tmp_path):
    with pytest.raises(TLSFileMissing, match="redis.tls.ca_file"):
        check_backing_tls(backing(cert_dir, ca_file=str(tmp_path / "absent.crt")), "redis.tls")


def test_not_pem_and_a_foreign_key(cert_dir, tmp_path):
    junk = tmp_path / "junk.crt"
    junk.write_text("not a certificate")
    with pytest.raises(TLSNotPEM):
        check_backing_tls(backing(cert_dir, cert_file=str(junk)), "etcd.tls")
    with pytest.raises(TLSKeyMismatch):
        check_backing_tls(backing(cert_dir, key_file=str(certs.key_path(cert_dir, "worker"))), "etcd.tls")


def test_an_expired_client_certificate(cert_dir, tmp_path):
    now = dt.datetime.now(dt.timezone.utc)
    certs.write_role(
        tmp_path,
        certs.load_authority(cert_dir),
        "router",
        not_before=now - dt.timedelta(days=10),
        not_after=now - dt.timedelta(days=1),
    )
    with pytest.raises(TLSCertExpired, match="kafka.tls.cert_file"):
        check_backing_tls(
            backing(
                cert_dir,
                cert_file=str(certs.cert_path(tmp_path, "router")),
                key_file=str(certs.key_path(tmp_path, "router")),
            ),
            "kafka.tls",
        )


def test_half_given_settings_are_refused():
    with pytest.raises(ValidationError):
        BackingTLSConfig(enabled=True, cert_file="a.crt")
    with pytest.raises(ValidationError):
        EtcdConfig(username="ballast")
    with pytest.raises(ValidationError):
        KafkaConfig(sasl_mechanism="SCRAM-SHA-512", username="ballast")
    with pytest.raises(ValidationError):
        KafkaConfig(sasl_mechanism="GSSAPI", username="a", password="b")


def test_kafka_security_properties():
    assert KafkaConfig().security_properties() == {}
    tls = BackingTLSConfig(enabled=True, ca_file="ca.crt", cert_file="c.crt", key_file="c.key")
    assert KafkaConfig(tls=tls).security_properties() == {
        "security.protocol": "SSL",
        "ssl.ca.location": "ca.crt",
        "ssl.certificate.location": "c.crt",
        "ssl.key.location": "c.key",
    }
    sasl = KafkaConfig(sasl_mechanism="SCRAM-SHA-256", username="u", password="p")
    assert sasl.security_properties() == {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.username": "u",
        "sasl.password": "p",
    }
    both = KafkaConfig(sasl_mechanism="PLAIN", username="u", password="p", tls=BackingTLSConfig(enabled=True))
    assert both.security_properties()["security.protocol"] == "SASL_SSL"
    assert "ssl.ca.location" not in both.security_properties()  # the system's trust store


def test_redis_connection_settings():
    assert RedisConfig().connection_kwargs() == {}
    assert RedisConfig().effective_url == "redis://127.0.0.1:6379/0"
    tls = BackingTLSConfig(enabled=True, ca_file="ca.crt", cert_file="c.crt", key_file="c.key")
    secured = RedisConfig(username="ballast", password="p", tls=tls)
    assert secured.effective_url == "rediss://127.0.0.1:6379/0"
    assert secured.connection_kwargs() == {
        "username": "ballast",
        "password": "p",
        "ssl_ca_certs": "ca.crt",
        "ssl_certfile": "c.crt",
        "ssl_keyfile": "c.key",
    }


def test_a_service_refuses_to_start_with_a_bad_backing_file(cert_dir, tmp_path, capsys):
    from services.entrypoint import run_main

    path = tmp_path / "ballast.yaml"
    path.write_text(f"etcd:\n  tls:\n    enabled: true\n    ca_file: {tmp_path / 'absent.crt'}\n")

    async def serve(_config):
        raise AssertionError("must not serve")

    assert run_main("ballast-router", None, serve, ["--config", str(path)], role="router") == 2
    assert "etcd.tls.ca_file" in capsys.readouterr().err


def test_logs_never_show_a_password_in_the_redis_url():
    assert (
        RedisConfig(url="rediss://ballast:s3cret@redis.internal:6379/0").display_url == "rediss://redis.internal:6379/0"
    )


def test_the_secured_local_broker_is_reached_only_through_its_tls_front(tmp_path):
    security = BackingSecurity(certs.init_certs(tmp_path / "certs", roles=("kafka", "cli")), "pw")
    broker = SecureKafkaBroker(tmp_path, security=security)
    # Tansu listens on its own port and tells clients to come back to the front's.
    assert broker.inner_port != broker.port
    assert broker._argv("tansu")[2:6] == [
        "--listener-url",
        f"tcp://127.0.0.1:{broker.inner_port}",
        "--advertised-listener-url",
        f"tcp://127.0.0.1:{broker.port}",
    ]
    assert broker.client_properties()["security.protocol"] == "SSL"
    settings = dict(line.split(" = ", 1) for line in broker.front._config_text().splitlines() if " = " in line)
    assert settings["accept"] == f"127.0.0.1:{broker.port}"
    assert settings["connect"] == f"127.0.0.1:{broker.inner_port}"
    assert settings["requireCert"] == "yes" and settings["verifyChain"] == "yes"
    assert settings["cert"] == str(certs.cert_path(security.certs_dir, "kafka"))


def test_a_secure_mesh_points_every_service_at_the_tls_broker(tmp_path):
    mesh = Mesh(MeshSpec(state_dir=tmp_path, model_dir=tmp_path / "model", secure=True))
    # A certificate directory made before Kafka was secured gets the broker's certificate.
    certs.init_certs(mesh.certs_dir, roles=certs.ROLES + ("etcd", "redis"))
    assert not certs.cert_path(mesh.certs_dir, "kafka").exists()
    mesh.ensure_certs()
    assert certs.cert_path(mesh.certs_dir, "kafka").exists()

    kafka = KafkaConfig(**mesh.config_dict()["kafka"])
    assert kafka.bootstrap == f"127.0.0.1:{mesh.kafka.port}"
    assert kafka.security_properties()["security.protocol"] == "SSL"
    env = mesh._service_process("backfill", "services.backfill", {}).env
    assert env["BALLAST__KAFKA__TLS__CERT_FILE"] == str(certs.cert_path(mesh.certs_dir, "backfill"))
