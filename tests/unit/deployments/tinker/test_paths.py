"""What a tinker path may be and reach (`deployments.tinker.paths`), and the routes that check it, over the fake
learner and fleet of `test_service`: names no listing could parse are refused before anything is saved, a path is
taken only by the routes of its kind, `save_state` replaces a name only with `overwrite` and keeps the user's metadata,
and a published version is verified under the key the fleet derives for its owner."""

import pytest
from tinker import types

from contracts.auth import Secret, lineage_key, signing_secret
from core.bucket import tinker_paths
from deployments.tinker.paths import PathRefused, checkpoint_path, owner_key, require_kind, user_metadata
from tests.unit.deployments.tinker.test_service import FakeLearner, client, new_model, post, result

BAD_NAMES = ("a/b", "", "..", "tab\there", "x" * 300)


def test_a_name_is_one_the_sdks_own_parser_gives_back():
    assert checkpoint_path("m:train:0", "training", "step-1") == "tinker://m:train:0/weights/step-1"
    assert checkpoint_path("m", "sampler", "000040") == "tinker://m/sampler_weights/000040"
    assert checkpoint_path("m", "external", "download") == "tinker://m/external_weights/download"
    for name in BAD_NAMES:
        with pytest.raises(PathRefused):
            checkpoint_path("m", "training", name)


def test_a_record_of_another_kind_is_refused_and_metadata_is_bounded():
    require_kind({"path": "tinker://m/weights/a", "kind": "training", "number": 1}, "training", "p")
    with pytest.raises(PathRefused, match="names sampler weights; this call takes training"):
        require_kind({"path": "tinker://m/weights/a", "kind": "sampler", "number": 1}, "training", "p")
    assert user_metadata(None) is None and user_metadata({"a": "b"}) == {"a": "b"}
    with pytest.raises(PathRefused):
        user_metadata({str(i): "v" for i in range(100)})


def test_a_published_version_is_verified_under_the_key_the_fleet_gives_its_owner():
    """The fleet hands run `alice` `lineage_key(signing_secret(admin token), "alice")` (`GET /v1/signing_key`)."""
    prefix = "s3://bucket/runs/alice"
    assert owner_key(Secret("admin-token-of-the-fleet"), prefix) == (
        lineage_key(signing_secret("admin-token-of-the-fleet"), "alice").value
    )
    assert owner_key(None, prefix) == lineage_key(signing_secret(None), "alice").value


def _model(http) -> tuple[str, str]:
    session_id, future = new_model(http)
    return session_id, result(http, future.json()["request_id"]).json()["model_id"]


def test_a_checkpoint_name_no_listing_could_parse_is_refused_before_anything_is_saved():
    http, learner = client()
    with http:
        _, model_id = _model(http)
        seq = 0
        for name in BAD_NAMES:
            for route, kind in (
                ("save_weights", types.SaveWeightsRequest),
                ("save_weights_for_sampler", types.SaveWeightsForSamplerRequest),
                ("save_weights_external", types.SaveWeightsExternalRequest),
            ):
                seq += 1
                refused = post(http, route, kind(model_id=model_id, path=name, seq_id=seq))
                assert refused.status_code == 400 and "checkpoint name" in refused.json()["detail"], (route, name)
        assert not [c for c in learner.calls if c[0] in ("save_state", "publish", "export")]


def test_a_path_is_taken_only_by_the_routes_of_its_kind():
    """Each kind numbers from 1 in a store of its own: a sampler or export path given to `load_weights`, or a state or
    export path given to `create_sampling_session`, is a 400, never the other store's checkpoint of that number."""
    learner = FakeLearner()
    http, _ = client(max_per_tenant=2, learner=learner)
    with http:
        session_id, model_id = _model(http)
        saved = post(http, "save_weights", types.SaveWeightsRequest(model_id=model_id, path="k", seq_id=1))
        state = result(http, saved.json()["request_id"]).json()["path"]
        request = types.SaveWeightsForSamplerRequest(model_id=model_id, path="k", seq_id=2)
        sampler = result(http, post(http, "save_weights_for_sampler", request).json()["request_id"]).json()["path"]
        request = types.SaveWeightsExternalRequest(model_id=model_id, path="k", seq_id=3)
        export = result(http, post(http, "save_weights_external", request).json()["request_id"]).json()["path"]
        for path in (sampler, export):
            load = types.LoadWeightsRequest(path=path, session_id=session_id, model_seq_id=1, optimizer=False)
            refused = post(http, "load_weights", load)
            assert refused.status_code == 400 and "takes training weights" in refused.json()["detail"], refused.text
        for path in (state, export):
            sampling = types.CreateSamplingSessionRequest(
                session_id=session_id, sampling_session_seq_id=0, model_path=path
            )
            refused = post(http, "create_sampling_session", sampling)
            assert refused.status_code == 400 and "takes sampler weights" in refused.json()["detail"], refused.text
        assert not [c for c in learner.calls if c[0] in ("load_state", "adopt")]
        load = types.LoadWeightsRequest(path=state, session_id=session_id, model_seq_id=1, optimizer=False)
        assert result(http, post(http, "load_weights", load).json()["request_id"]).status_code == 200
        assert learner.calls[-1][0] == "load_state"


def test_save_state_replaces_a_name_only_with_overwrite_and_keeps_the_users_metadata():
    learner = FakeLearner()
    http, _ = client(learner=learner)
    prefix = f"file://{learner.root}/bucket/runs/alice"  # alice's prefix of the fake fleet's bucket
    with http:
        _, model_id = _model(http)
        path = f"tinker://{model_id}/weights/x"
        tinker_paths.remember(prefix, path, "training", 1)  # saved before
        asked = types.SaveWeightsRequest(
            model_id=model_id, path="x", seq_id=1, overwrite=True, user_metadata={"stage": "b"}
        )
        assert result(http, post(http, "save_weights", asked).json()["request_id"]).json()["path"] == path
        record = tinker_paths.own_record(prefix, path)
        assert record["number"] == learner.saves == 1 and record["user_metadata"] == {"stage": "b"}
        again = types.SaveWeightsRequest(model_id=model_id, path="x", seq_id=2)
        refused = post(http, "save_weights", again)
        assert refused.status_code == 400 and "overwrite=True" in refused.json()["detail"]
        assert [c[0] for c in learner.calls].count("save_state") == 1
