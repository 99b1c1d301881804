"""The example of docs/language_models.md runs as written (offline, tiny random models)."""
import re
from pathlib import Path

from _hf_helpers import no_network  # noqa: F401

DOC = Path(__file__).resolve().parents[1] / 'docs' / 'language_models.md'


def test_the_language_models_example_runs(tmp_path, monkeypatch):
    (snippet,) = re.findall(r'```python\n(.*?)```', DOC.read_text(encoding='utf-8'), re.S)
    monkeypatch.chdir(tmp_path)  # it saves a folder
    exec(compile(snippet, str(DOC), 'exec'), {'__name__': '__doc_example__'})
    assert (tmp_path / 'gpt2-afbo' / 'vitblocks_model.safetensors').is_file()


def test_the_readme_links_the_page():
    assert 'docs/language_models.md' in (DOC.parents[1] / 'README.md').read_text(encoding='utf-8')
