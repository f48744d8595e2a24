"""README's links into docs/ and the repository: `mkdocs build --strict` checks the links
between docs/ pages, but README.md is outside the site, so its relative links are checked here."""
import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_relative_links_name_existing_files():
    readme = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in LINK.findall(readme) if "://" not in t and not t.startswith("#")]
    assert "docs/index.md" in targets and "docs/configuration.md" in targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
