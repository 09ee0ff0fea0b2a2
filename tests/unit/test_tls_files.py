"""Start-up checks of the TLS files: each unusable file is refused with its own error type."""

import datetime as dt

import pytest

from services.cli import certs
from services.common.config import ConfigError
from services.common.tls.material import (
    TLSCertExpired,
    TLSCertNotYetValid,
    TLSCertUntrusted,
    TLSConfigError,
    TLSFileMissing,
    TLSFileUnreadable,
    TLSKeyMismatch,
    TLSNotPEM,
    TLSRoleMismatch,
    check_identity,
    load_identity,
)
from services.common.tls.settings import TLSConfig
from services.config import load_config


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory):
    return certs.init_certs(tmp_path_factory.mktemp("certs"), roles=("router", "worker"))


def config(directory, role="router", **changes):
    fields = dict(
        enabled=True,
        ca_file=str(directory / certs.CA_CERT),
        cert_file=str(certs.cert_path(directory, role)),
        key_file=str(certs.key_path(directory, role)),
    )
    fields.update(changes)
    return TLSConfig(**fields)


def test_generated_files_pass_and_name_their_role(cert_dir):
    identity = load_identity(config(cert_dir), "router")
    assert identity.role == "router"
    assert b"BEGIN CERTIFICATE" in identity.cert_pem


def test_off_checks_nothing():
    check_identity(TLSConfig(), "router")


def test_enabled_without_files_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="tls"):
        load_config(environ={"BALLAST__TLS__ENABLED": "true"})


def test_missing_file(cert_dir, tmp_path):
    with pytest.raises(TLSFileMissing):
        load_identity(config(cert_dir, cert_file=str(tmp_path / "absent.crt")))


def test_unreadable_file(cert_dir, tmp_path):
    # A folder where the key should be: exists, cannot be read as a file.
    with pytest.raises(TLSFileUnreadable):
        load_identity(config(cert_dir, key_file=str(tmp_path)))


def test_not_pem(cert_dir, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    for field in ("ca_file", "cert_file", "key_file"):
        with pytest.raises(TLSNotPEM):
            load_identity(config(cert_dir, **{field: str(junk)}))


def test_key_of_another_certificate(cert_dir):
    with pytest.raises(TLSKeyMismatch):
        load_identity(config(cert_dir, key_file=str(certs.key_path(cert_dir, "worker"))))


def _with_validity(directory, tmp_path, not_before, not_after):
    authority = certs.load_authority(directory)
    out = tmp_path / "dated"
    out.mkdir()
    certs.write_role(out, authority, "router", not_before=not_before, not_after=not_after)
    return config(directory, cert_file=str(certs.cert_path(out, "router")), key_file=str(certs.key_path(out, "router")))


def test_expired(cert_dir, tmp_path):
    now = dt.datetime.now(dt.timezone.utc)
    with pytest.raises(TLSCertExpired):
        load_identity(_with_validity(cert_dir, tmp_path, now - dt.timedelta(days=10), now - dt.timedelta(days=1)))


def test_not_yet_valid(cert_dir, tmp_path):
    now = dt.datetime.now(dt.timezone.utc)
    with pytest.raises(TLSCertNotYetValid):
        load_identity(_with_validity(cert_dir, tmp_path, now + dt.timedelta(days=1), now + dt.timedelta(days=10)))


def test_signed_by_another_ca(cert_dir, tmp_path):
    other = certs.init_certs(tmp_path / "other", roles=("router",))
    with pytest.raises(TLSCertUntrusted):
        load_identity(config(other, ca_file=str(cert_dir / certs.CA_CERT)))


def test_certificate_of_another_role(cert_dir):
    with pytest.raises(TLSRoleMismatch):
        load_identity(config(cert_dir, role="worker"), "router")


def test_every_refusal_is_a_config_error():
    assert issubclass(TLSConfigError, ConfigError)


def test_a_service_refuses_to_start_with_a_bad_file(cert_dir, tmp_path, capsys):
    from services.entrypoint import run_main

    path = tmp_path / "ballast.yaml"
    path.write_text(
        f"tls:\n  enabled: true\n  ca_file: {cert_dir / certs.CA_CERT}\n"
        f"  cert_file: {tmp_path / 'absent.crt'}\n  key_file: {certs.key_path(cert_dir, 'router')}\n"
    )

    async def serve(_config):
        raise AssertionError("must not serve")

    assert run_main("ballast-router", None, serve, ["--config", str(path)], role="router") == 2
    assert "tls.cert_file" in capsys.readouterr().err
