"""How a starting service reads its settings: the whole file checked across services, or its own environment."""

from __future__ import annotations

import pytest

from shared.config.pipeline import PipelineError, load_or_exit, load_service


def test_without_a_file_a_service_reads_only_its_own_settings(monkeypatch):
    monkeypatch.delenv("ASYNCGRPO_CONFIG", raising=False)
    monkeypatch.setenv("SCORER_PORT", "9123")
    assert load_service(None, "scorer").port == 9123  # no generator.model needed without a file


def test_with_a_file_a_bad_table_of_another_service_stops_the_start(tmp_path, monkeypatch, capsys):
    path = tmp_path / "pipeline.toml"
    path.write_text(
        '[generator]\nmodel = "m"\nmax_model_len = 100\n[learner]\nmodel = "m"\n'
        "max_prompt_length = 64\nmax_completion_length = 64\n"
    )
    monkeypatch.setenv("ASYNCGRPO_CONFIG", str(path))
    with pytest.raises(PipelineError, match=r"generator.max_model_len \(100\) is below learner.max_prompt_length"):
        load_service(None, "scorer")
    with pytest.raises(SystemExit) as exit_:
        load_or_exit(path, "scorer")
    assert exit_.value.code == 2 and "max_model_len" in capsys.readouterr().err


def test_a_file_may_leave_out_the_tables_of_services_deployed_elsewhere(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYNCGRPO_CONFIG", raising=False)
    path = tmp_path / "scorer-only.toml"
    path.write_text('[scorer]\nport = 9124\nrewards = [{ name = "mark" }]\n')
    assert load_service(path, "scorer").port == 9124  # no [generator] or [learner] here: not theirs to check
    path.write_text(path.read_text() + '[generator]\nmodel = "m"\nmax_model_len = 100\n[learner]\nmodel = "m"\n')
    with pytest.raises(PipelineError, match=r"generator.max_model_len \(100\) is below"):
        load_service(path, "scorer")  # the tables it has are checked across, scorer table complete or not
    path.write_text('[scorer]\nport = 9124\n[generator]\nmodel = ""\n')
    with pytest.raises(PipelineError, match=r"generator\.model is required"):
        load_service(path, "scorer")
