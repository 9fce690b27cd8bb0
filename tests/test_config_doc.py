"""docs/configuration.md is what the settings models say: regenerate it when a setting changes."""

from pathlib import Path

from hybrid_pd.config_doc import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_configuration_reference_matches_the_settings_models():
    assert DOC.read_text() == render(), "docs/configuration.md is stale: python -m hybrid_pd.config_doc > docs/configuration.md"


def test_every_setting_has_a_row_and_a_meaning():
    from hybrid_pd.router.settings import RouterSettings
    from hybrid_pd.worker.settings import WorkerSettings

    text = render()
    for model in (RouterSettings, WorkerSettings):
        prefix = model.model_config["env_prefix"]
        for name, field in model.model_fields.items():
            assert f"`{prefix}{name.upper()}`" in text
            assert field.description, f"{model.__name__}.{name} has no description"
