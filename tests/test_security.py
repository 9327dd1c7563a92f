"""What a run exposes: the token it sends, the files it loads. (What the Ray that `fit` starts
listens on is checked on tests/test_startup.py's shared run.)"""

from __future__ import annotations


def test_the_token_file_submit_carried_is_deleted_once_read(tmp_path):
    """The ``serve-token`` in Ray's unpacked copy of a job's working directory is gone once
    serve has read it; a token file of the user's own stays."""
    from raytrain_mnist.serve import read_token_file

    token = "t0ken-0123456789abcdef"
    carried = tmp_path / "runtime_resources" / "working_dir_files" / "_ray_pkg_1" / "serve-token"
    carried.parent.mkdir(parents=True)
    carried.write_text(f"{token}\nrandom line\n")
    assert read_token_file(str(carried)) == token
    assert not carried.exists()
    own = tmp_path / "serve-token"
    own.write_text(token + "\n")
    assert read_token_file(str(own)) == token and own.exists()


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
