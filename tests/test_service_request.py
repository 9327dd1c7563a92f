"""A service's request, checked in one place (no Ray): every spelling of a path that
leaves the service's storage roots, a planted link, a run its requester does not hold, a
checkpoint outside its run, settings the data cannot feed; and the request value itself
across Ray (``to_dict``/``from_dict``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from raytrain_mnist.config import TrainConfig
from raytrain_mnist.driver.runs import Run
from raytrain_mnist.driver.service.request import (
    CLAIM_FILE,
    canonical,
    check_request,
    forget_claim,
    within_roots,
    write_claim,
)
from raytrain_mnist.service_request import RequestError, ServiceRequest


@pytest.fixture
def roots(tmp_path) -> Iterator[dict]:
    """A storage root holding a claimed run ``r``, a place outside it, and the rules of a
    service of two workers on 600 images."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    rules = {"storage_roots": [str(root.resolve())], "num_workers": 2, "data": {"train_size": 600}}
    with Run(str(root), "r").claim() as run:
        write_claim(run.files, "token")
        yield {"root": root, "outside": outside, "rules": rules}


def _request(storage, name: str = "r", **changes) -> dict:
    request = ServiceRequest(
        TrainConfig(epochs=1, batch_size=32), str(storage), name, claim="token"
    )
    return {**request.to_dict(), **changes}


def _refused(values: dict, rules: dict, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        check_request(values, rules)


def test_a_good_request_is_accepted_as_what_it_names(roots):
    root = roots["root"]
    (root / "r" / "checkpoint_000001").mkdir()
    checked = check_request(
        _request(f"file://{root}/", resume_from=f"{root}/r/checkpoint_000001"), roots["rules"]
    )
    assert checked.storage == str(root.resolve()) and checked.run_dir == f"{root.resolve()}/r"
    assert checked.resume_from == f"{root.resolve()}/r/checkpoint_000001"


def test_the_request_value_round_trips_and_refuses_what_it_cannot_hold(roots):
    request = ServiceRequest(
        TrainConfig(epochs=3), "/x", "r", "/x/r/c", True, False, "off", 4, "t", "id"
    )
    assert ServiceRequest.from_dict(request.to_dict()) == request
    bad = request.to_dict()
    for changes, match in [
        ({"code": "import os"}, "a request holds"),
        ({"train": {"epochs": 1, "lr": float("nan")}}, "--lr must be a positive number"),
        ({"train": {"epochs": 1, "exec": "x"}}, "unknown training setting"),
        ({"keep": 0}, "--keep-checkpoints"),
        ({"keep": True}, "--keep-checkpoints"),
        ({"progress": "yes"}, "progress is true or false"),
        ({"resume_from": 7}, "resume_from is a path"),
        ({"storage": b"/x"}, "storage is a string"),
    ]:
        with pytest.raises(RequestError, match=match):
            ServiceRequest.from_dict({**bad, **changes})
    with pytest.raises(RequestError, match="a request holds"):
        ServiceRequest.from_dict({k: v for k, v in bad.items() if k != "claim"})
    with pytest.raises(RequestError, match="a request is a dict"):
        ServiceRequest.from_dict(["train"])


def test_settings_the_data_cannot_feed_are_refused_as_fit_refuses_them(roots):
    train = TrainConfig(epochs=1, batch_size=4096).to_dict()
    _refused(_request(roots["root"], train=train), roots["rules"], "an epoch would have no step")
    train = TrainConfig(epochs=1, batch_size=1).to_dict()
    _refused(_request(roots["root"], train=train), roots["rules"], "smaller than 2 workers")


def _outside_spellings(root: Path, outside: Path) -> list[str]:
    link = root / "link"
    link.symlink_to(outside)
    return [
        str(outside),
        f"{root}/../outside",
        f"{root}/sub/../../outside",
        f"{root}/link",  # a link under a root, to a place outside it
        f"file://{root}/link",
        f"file://{root}/%2e%2e/outside",  # %2e%2e is .. to the store
        f"file://{root}/%252e%252e/outside",
        f"file://elsewhere{root}",
        f"FILE://{root}/../outside",
        str(root) + "/..",
        f"{root}/./..",
        f"{root}\x00",
        "",
    ]


def test_every_spelling_of_a_path_outside_the_roots_is_refused(roots):
    for storage in _outside_spellings(roots["root"], roots["outside"]):
        _refused(_request(storage), roots["rules"], "outside the service's storage roots")


@pytest.mark.parametrize(
    "storage",
    [
        "s3://bucket/runs/%2e%2e/other",
        "s3://bucket/runs/../other",
        "s3://bucket/runs/./x/..",
        "s3://bucket/runs//x",
        "s3://bucket/runs?x=1",
        "s3://bucket/runs#x",
        "s3://bucket-other/runs",
        "s3://bucket/runsx",
        "gs://bucket/runs",
    ],
)
def test_a_uri_outside_a_uri_root_in_any_spelling_is_refused(storage):
    roots = ["s3://bucket/runs"]
    assert not within_roots(storage, roots)
    assert within_roots("s3://bucket/runs/team", roots)
    assert within_roots("S3://bucket/runs", roots)


def test_a_run_name_that_is_a_planted_link_is_refused(roots):
    (roots["root"] / "planted").symlink_to(roots["outside"])
    _refused(_request(roots["root"], "planted"), roots["rules"], "is a symbolic link")


@pytest.mark.parametrize("name", ["../x", "..", ".", "a/b", "x%2f", "", "a\nb"])
def test_a_run_name_that_is_no_plain_name_is_refused(roots, name):
    _refused(_request(roots["root"], name), roots["rules"], "is not a plain name")


def test_a_checkpoint_outside_its_run_in_any_spelling_is_refused(roots):
    root = roots["root"]
    (root / "other" / "checkpoint_1").mkdir(parents=True)
    (root / "r" / "linked").symlink_to(root / "other" / "checkpoint_1")
    for resume in [
        "/etc",
        f"{root}/other/checkpoint_1",
        f"{root}/r/../other/checkpoint_1",
        f"{root}/r/linked",
        f"{root}/r",
        f"{root}/r/a/b",
        f"file://{root}/r/%2e%2e/other/checkpoint_1",
    ]:
        _refused(_request(root, resume_from=resume), roots["rules"], "is not one of run 'r''s")


def test_a_run_its_requester_does_not_hold_is_refused(roots):
    root, rules = roots["root"], roots["rules"]
    match = "is not claimed by this request's requester"
    _refused(_request(root, claim="guess"), rules, match)
    _refused(_request(root, claim=""), rules, match)
    (root / "free").mkdir()  # nobody holds it, though its token is right
    (root / "free" / CLAIM_FILE).write_text("token")
    _refused(_request(root, "free"), rules, match)
    with Run(str(root), "held").claim():  # held, but through a linked token file
        (root / "held" / CLAIM_FILE).symlink_to(root / "r" / CLAIM_FILE)
        _refused(_request(root, "held"), rules, match)


def test_canonical_names_a_path_once():
    assert canonical("s3://Bucket/a/b/") == "s3://Bucket/a/b"
    assert canonical("file:///tmp/../tmp") == os.path.realpath("/tmp")
    for bad in ("s3://", "s3://b/%41", "weird scheme://x", None, 7, "file://h/x"):
        assert canonical(bad) is None


def test_a_claim_token_is_never_written_through_a_link(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep")
    with Run(str(tmp_path), "r").claim() as run:
        (tmp_path / "r" / CLAIM_FILE).symlink_to(target)
        write_claim(run.files, "token")
        assert not (tmp_path / "r" / CLAIM_FILE).is_symlink()
        forget_claim(run.files)  # the request was refused: the run is left as it was
    assert target.read_text() == "keep"
    assert not (tmp_path / "r").exists()


def test_an_unreadable_claim_is_no_claim(roots):
    with contextlib.suppress(FileNotFoundError):
        os.unlink(roots["root"] / "r" / CLAIM_FILE)
    (roots["root"] / "r" / CLAIM_FILE).mkdir()
    _refused(_request(roots["root"]), roots["rules"], "is not claimed")


def test_a_run_on_an_object_store_is_claimed_by_its_lease_and_token(s3):
    """On S3 the claim is a lease beside the run: a token without it is no claim."""
    root = s3()
    rules = {"storage_roots": [root], "num_workers": 2, "data": {"train_size": 600}}
    with Run(root, "r").claim() as run:
        write_claim(run.files, "token")
        assert check_request(_request(root), rules).run_dir == f"{root}/r"
        _refused(_request(root, claim="guess"), rules, "is not claimed")
    write_claim(Run(root, "r").files, "token")  # the lease is gone with its command
    _refused(_request(root), rules, "is not claimed")
