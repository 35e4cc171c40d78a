"""scripts/diagnose_decode.py (a GPU debugging aid) runs end to end; without a kernel both paths are the reference,
so every error it reports must be exactly 0 -- which also makes its breakdown checkable here."""

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "diagnose_decode", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "diagnose_decode.py")
diagnose = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(diagnose)


def test_diagnose_decode_reports_no_error_when_both_paths_agree(capsys, monkeypatch):
    monkeypatch.setattr(diagnose.fm, "kernel_formats", lambda: ())  # force the reference on both sides
    rc = diagnose.main(["--format", "fp8_ds_mla", "--b", "2", "--s-q", "2", "--h-q", "8", "--seqlens", "90,0",
                        "--causal", "--num-sms", "4"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "overall rel-L2 0.000e+00; NaN in out 0, inf 0" in text
    assert "+inf rows agree False" not in text
    assert "seq 1 s 1" in text  # every (sequence, query position) gets a line, the empty sequence too
