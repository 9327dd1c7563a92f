"""What a run exposes: the token it sends, the files it loads. (What the Ray that `fit` starts
listens on is checked on tests/test_startup.py's shared run.)"""

from __future__ import annotations

import pytest


def test_a_token_hash_checks_the_token_and_does_not_hold_it():
    """What the cluster gets of a serve token: a salted hash that accepts the token and
    nothing else, differs for every salting of the same token, and holds no part of it."""
    import secrets

    from raytrain_mnist.errors import ConfigError
    from raytrain_mnist.serving.settings import TokenHash

    token = secrets.token_urlsafe()
    hashed = TokenHash.of(token)
    again = TokenHash.of(token)
    line = hashed.line()
    assert token not in line and token not in repr(hashed) and line != again.line()
    for read in (hashed, again, TokenHash.parse(f"  {line}\n", "f")):
        assert read.accepts(token.encode())
        for wrong in (
            token[:-1],
            token + "x",
            "",
            token.upper() if token.lower() == token else token.lower(),
        ):
            assert not read.accepts(wrong.encode())
    for bad in (token, line[:-1], line.replace("sha256", "md5"), line.upper(), ""):
        with pytest.raises(ConfigError, match="^F is not a token hash") as info:
            TokenHash.parse(bad, "F")
        assert token not in str(info.value)


def test_a_checkpoint_with_non_finite_weights_is_refused_at_load(tmp_path):
    """A diverged run's weights (NaN, inf) would make every /predict an error: serve refuses
    the checkpoint in one line, before anything starts."""
    from raytrain_mnist.nn import checkpoint as ckpt
    from raytrain_mnist.nn.model import ConvNet

    from .conftest import run_cli_here

    weights = ConvNet().state_dict()
    next(v for v in weights.values() if v.is_floating_point()).view(-1)[0] = float("nan")
    path = tmp_path / "checkpoint_000000"
    path.mkdir()
    ckpt.save(path, {"model": weights, "epoch": 0})
    result = run_cli_here("serve", str(path), "--write-config", str(tmp_path / "c.yaml"))
    assert result.returncode != 0 and "non-finite weights" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "c.yaml").exists()
