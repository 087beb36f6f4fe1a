"""The committed generated code is exactly what `make proto` produces from proto/."""

from fedse import protogen


def test_generated_code_matches_proto(tmp_path):
    protogen.generate(tmp_path)
    committed = protogen.REPO / "fedse" / "v1"
    fresh = sorted(p.relative_to(tmp_path / "fedse" / "v1") for p in (tmp_path / "fedse" / "v1").iterdir())
    assert fresh, "protoc generated nothing"
    for rel in fresh:
        assert (committed / rel).exists(), f"fedse/v1/{rel} is not committed: run `make proto`"
        assert (committed / rel).read_bytes() == (tmp_path / "fedse" / "v1" / rel).read_bytes(), (
            f"fedse/v1/{rel} differs from proto/: run `make proto` and commit the result")
    extra = {p.name for p in committed.iterdir() if p.suffix in (".py", ".pyi") and p.name != "__init__.py"}
    assert extra == {str(p) for p in fresh}, "generated files without a .proto: remove them"
