"""`fleetshift certs ...`: the CA, the certificates it issues and operator tokens."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from fleetshift_common.config import ConfigError
from fleetshift_rpc import pki
from fleetshift_rpc.security import (
    OperatorTokens,
    PrincipalKind,
    TlsFiles,
    TokenFile,
    principal_from_pem,
)


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_cli_issues_a_ca_and_certificates_bound_to_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "pki"
    assert pki.main(["init-ca", str(d), "--days", "90"]) == 0
    args = ["issue-node", str(d), "h100-7", "--san-ip", "10.0.0.7", "--san-dns", "h100-7.lan"]
    assert pki.main([*args, "--days", "7"]) == 0
    assert pki.main(["issue-operator", str(d), "alice"]) == 0
    assert pki.main(["issue-server", str(d), "fleetshiftd", "--san-ip", "127.0.0.1"]) == 0
    assert "node-h100-7.crt" in capsys.readouterr().out

    ca = load(d / "ca.crt")
    node = load(d / "node-h100-7.crt")
    for cert in (ca, node):
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
        assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    node.verify_directly_issued_by(ca)
    days = (node.not_valid_after_utc - node.not_valid_before_utc) / datetime.timedelta(days=1)
    assert 7 <= days < 7.01
    sans = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == ["fleetshift://node/h100-7"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert sans.get_values_for_type(x509.DNSName) == ["h100-7.lan"]
    assert principal_from_pem((d / "node-h100-7.crt").read_bytes()) == (
        PrincipalKind.NODE,
        "h100-7",
    )
    assert principal_from_pem((d / "operator-alice.crt").read_bytes()) == (
        PrincipalKind.OPERATOR,
        "alice",
    )
    assert principal_from_pem((d / "daemon-fleetshiftd.crt").read_bytes()) == (
        PrincipalKind.DAEMON,
        "fleetshiftd",
    )
    eku = load(d / "operator-alice.crt").extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    assert list(eku.value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    for key in d.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key


def test_cli_refuses_to_replace_a_ca_or_issue_without_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pki.main(["issue-node", str(tmp_path), "n1"]) == 2
    assert "no CA in" in capsys.readouterr().err
    assert pki.main(["init-ca", str(tmp_path)]) == 0
    before = (tmp_path / "ca.crt").read_bytes()
    assert pki.main(["init-ca", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "ca.crt").read_bytes() == before
    assert pki.main(["issue-node", str(tmp_path), "bad/name"]) == 2
    assert "name" in capsys.readouterr().err
    assert pki.main(["issue-node", str(tmp_path), "n1", "--san-ip", "nope"]) == 2
    assert "san_ip" in capsys.readouterr().err


def test_a_leaf_never_outlives_its_ca(tmp_path: Path) -> None:
    pki.init_ca(tmp_path, days=2)
    pair = pki.issue(tmp_path, "node", "n1", days=30)
    assert load(pair.cert).not_valid_after_utc <= load(tmp_path / "ca.crt").not_valid_after_utc


def test_operator_tokens_are_stored_hashed_and_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens_file = tmp_path / "operator-tokens"
    assert pki.main(["new-token", str(tokens_file), "alice"]) == 0
    token = capsys.readouterr().out.strip()
    bob_token = pki.new_token(tokens_file, "bob")
    text = tokens_file.read_text()
    assert token not in text and bob_token not in text
    assert stat.S_IMODE(tokens_file.stat().st_mode) == 0o600
    tokens = OperatorTokens.from_file(tokens_file)
    assert len(tokens) == 2
    assert tokens.operator_for(token) == "alice"
    assert tokens.operator_for(bob_token) == "bob"
    assert tokens.operator_for(token[:-1]) is None
    assert tokens.operator_for("") is None


def test_bad_token_files_are_refused_by_key(tmp_path: Path) -> None:
    bad = tmp_path / "tokens"
    bad.write_text("alice plaintext-token\n")
    with pytest.raises(ConfigError) as err:
        OperatorTokens.from_file(bad)
    assert err.value.field == "operator_tokens_file" and ":1:" in err.value.message
    with pytest.raises(ConfigError):
        OperatorTokens.from_file(tmp_path / "missing")


def test_tls_files_must_be_set_together_and_name_the_holder(tmp_path: Path) -> None:
    assert TlsFiles.from_config("", "", "") is None
    pki.init_ca(tmp_path)
    pair = pki.issue(tmp_path, "node", "node-a")
    with pytest.raises(ConfigError) as err:
        TlsFiles.from_config(str(pair.cert), str(pair.key), "")
    assert err.value.field == "tls_ca"
    with pytest.raises(ConfigError) as err:
        TlsFiles.from_config(str(pair.cert), str(tmp_path / "nokey"), str(tmp_path / "ca.crt"))
    assert err.value.field == "tls_key"
    files = TlsFiles.from_config(str(pair.cert), str(pair.key), str(tmp_path / "ca.crt"))
    assert files is not None
    files.check_identity(PrincipalKind.NODE, "node-a")
    with pytest.raises(ConfigError) as err:
        files.check_identity(PrincipalKind.NODE, "node-b")
    assert "node:node-a" in err.value.message and "node:node-b" in err.value.message


def test_token_file_changes_apply_without_restart_and_fail_closed(tmp_path: Path) -> None:
    path = tmp_path / "operator-tokens"
    alice = pki.new_token(path, "alice")
    now = [0.0]
    tokens = TokenFile(path, check_every_s=2.0, clock=lambda: now[0])
    assert tokens.operator_for(alice) == "alice"
    bob = pki.new_token(path, "bob")
    assert tokens.operator_for(bob) is None  # not re-read before the interval
    now[0] += 2.0
    assert tokens.operator_for(bob) == "bob"
    # revoke alice: delete her line
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[1:]))
    now[0] += 2.0
    assert tokens.operator_for(alice) is None and tokens.operator_for(bob) == "bob"
    path.write_text("bob not-a-digest\n")
    now[0] += 2.0
    assert tokens.operator_for(bob) is None  # a broken file accepts nobody
    path.unlink()
    now[0] += 2.0
    assert tokens.operator_for(bob) is None
