"""The checks each CPU kind owes: a processor's kind named as its benchmark folder is, each kind owing the checks
its README says are unmeasured there, every check's variants changing the kernel's own choice on that kind, and a
run writing each check's rounds through the side-by-side tool."""

import json
import os

import pytest

from kvcache_op.benchmarks.cpu import pending, side_by_side
from kvcache_op.benchmarks.timing import kernel_build
from kvcache_op.capi import c_api


@pytest.fixture(autouse=True)
def no_choice_switches(monkeypatch):
    """Every test starts with no choice switch set, as the checks' runs must."""
    for name in pending.CHOICE_SWITCHES:
        monkeypatch.delenv(name, raising=False)


def cpuinfo(vendor: str, family: int, model: int) -> str:
    return (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
            "model name\t: Some Processor\n\nprocessor\t: 1\nvendor_id\t: Other\n")


@pytest.mark.parametrize("vendor, family, model, kind", [
    ("GenuineIntel", 6, 207, "intel-xeon-207"), ("GenuineIntel", 6, 167, "intel-xeon-167"),
    ("GenuineIntel", 6, 143, "intel-xeon-143"), ("AuthenticAMD", 25, 17, "amd-epyc-zen4"),
    ("AuthenticAMD", 25, 0xA0, "amd-epyc-zen4"), ("AuthenticAMD", 25, 1, "amd-epyc-zen3"),
    ("AuthenticAMD", 25, 0x21, "amd-epyc-zen3"), ("AuthenticAMD", 25, 0x90, "amd-epyc-zen4"),
    ("AuthenticAMD", 25, 0xB0, ""), ("AuthenticAMD", 26, 2, "amd-epyc"), ("AuthenticAMD", 26, 0x44, "amd-epyc"),
    ("AuthenticAMD", 26, 0x50, ""), ("AuthenticAMD", 26, 0xC0, ""), ("AuthenticAMD", 23, 49, ""), ("GenuineIntel", 15, 6, ""), ("HygonGenuine", 24, 1, ""),
])
def test_a_processors_kind_is_named_as_its_benchmark_folder_is(vendor, family, model, kind):
    assert pending.cpu_kind(cpuinfo(vendor, family, model)) == kind


def test_a_machine_without_x86_fields_has_no_kind():
    assert pending.cpu_kind("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n") == ""
    assert pending.cpu_kind("") == ""


def owed(kind: str) -> set:
    return {c.name for c in pending.CHECKS if c.owed(kind)}


def test_each_kind_owes_what_its_readme_says_is_unmeasured_there():
    intel = {"head-prefetch-l2", "token-streams", "token-prefetch", "streamed-heads-int8", "streamed-heads-float16",
             "code-stores", "gather-tiles"}
    assert owed("intel-xeon-143") == intel  # a kind never measured owes every Intel check
    assert owed("intel-xeon-167") == set()  # measured them all
    assert owed("intel-xeon-207") == set()  # measured them all
    assert owed("amd-epyc") == {"head-prefetch-l1"} and owed("amd-epyc-zen3") == set()  # Zen 3: measured
    assert owed("amd-epyc-zen4") == set() and owed("") == set()


def check_vendor(check) -> str:
    return "intel" if any(p.startswith("intel") for p in check.owed_by) else "amd"


@pytest.mark.parametrize("check", pending.CHECKS, ids=lambda c: c.name)
def test_every_variant_after_the_first_changes_the_kernels_own_choice_on_the_kind_that_owes_it(check, monkeypatch):
    """The first variant sets nothing (the kernel's own choice); under every other variant's settings the kernel
    reports other choices than its own for that vendor's processors (a misspelt switch, or a default since moved
    to the measured setting, would report the same). The reports are the choices passed to the kernel: that a
    check's cases take the path the choice steers is the check's own description, not tested here."""
    if c_api.cpu_kernel() not in check.builds:
        pytest.skip(f"{check.name} times the {'/'.join(check.builds)} build; the {c_api.cpu_kernel()} build is loaded")
    variants = [side_by_side.parse_variant(v) for v in check.variants]
    assert variants[0].env == {} and variants[0].library is None
    monkeypatch.setenv("KVCACHE_OP_CPU_VENDOR", check_vendor(check))
    own = kernel_build()
    assert own
    reported = {own}
    for variant in variants[1:]:
        assert variant.library is None and set(variant.env) <= set(pending.CHOICE_SWITCHES)
        with side_by_side.environment(variant.env):
            reported.add(kernel_build())
    assert len(reported) == len(variants), f"{check.name}: a variant reports the same choices as another"


@pytest.mark.parametrize("check", pending.CHECKS, ids=lambda c: c.name)
def test_every_checks_cases_are_cases_the_side_by_side_tool_takes(check):
    for case in check.cases:
        name, mode, quant_bit, layout = side_by_side.parse_case(case)
        side_by_side.shape_named(name)
        side_by_side.shape_named(side_by_side.parse_case(pending.quick_case(case))[0], quick=True)
    assert set(check.builds) <= {"avx512", "avx2", "generic"} and check.owed_by


def test_a_run_writes_each_checks_rounds_through_the_side_by_side_tool(tmp_path, capsys):
    check = next(c for c in pending.CHECKS if c.name == "head-prefetch-l1")
    assert pending.main(["--check", check.name, "--out", str(tmp_path), "--quick"]) == 0
    out = capsys.readouterr().out
    assert f"== {check.name}" in out and "ran 1 of 1 check(s)" in out
    record = json.loads((tmp_path / f"{check.name}.json").read_text())
    assert set(record["variants"]) == {"own", "l1"}
    assert record["variants"]["own"]["env"] == {}
    assert record["variants"]["l1"]["env"] == {"KVCACHE_OP_HEAD_PREFETCH": "l1"}
    cases = {pending.quick_case(c) for c in check.cases}
    assert {(r["case"], r["output_offset"]) for r in record["results"]} == {(c, o) for c in cases for o in (0, 16)}
    assert all(set(r["variants"]) == {"own", "l1"} for r in record["results"])


def test_a_check_for_another_build_is_passed_over_in_words(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(c_api, "cpu_kernel", lambda *a, **k: "generic")
    assert pending.main(["--check", "token-streams", "--out", str(tmp_path), "--quick"]) == 1  # named: not a result
    captured = capsys.readouterr()
    assert "passed over: it times the avx512 build, and the generic build is loaded" in captured.out
    assert "ran 0 of 1 check(s)" in captured.out and not os.listdir(tmp_path)
    assert "not run, though named with --check: token-streams" in captured.err


def test_a_kind_that_owes_nothing_says_so_and_times_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pending, "owing_kind", lambda: "amd-epyc-zen4")
    assert pending.main(["--out", str(tmp_path)]) == 0
    assert "(amd-epyc-zen4) owes no check" in capsys.readouterr().out and not os.listdir(tmp_path)


@pytest.mark.parametrize("vendor, family, model, stand_in, checks", [
    ("GenuineIntel", 19, 1, "intel-xeon-unnamed", "intel-xeon-*"),
    ("AuthenticAMD", 26, 0xC0, "amd-epyc-unnamed", "amd-epyc*"),
])
def test_an_intel_or_amd_processor_of_no_named_kind_owes_every_check_of_its_vendor(vendor, family, model, stand_in,
                                                                                    checks):
    """It runs its vendor's kernel choices unmeasured: it told the user it owed nothing."""
    info = cpuinfo(vendor, family, model)
    assert pending.cpu_kind(info) == "" and pending.owing_kind(info) == stand_in
    assert owed(stand_in) == {c.name for c in pending.CHECKS if checks in c.owed_by} != set()


def test_a_processor_of_another_vendor_owes_no_check():
    assert pending.owing_kind(cpuinfo("HygonGenuine", 24, 1)) == ""
    assert pending.owing_kind("processor\t: 0\nCPU implementer\t: 0x41\n") == ""


def test_an_unnamed_kind_is_told_it_owes_its_vendors_checks(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pending, "owing_kind", lambda: "intel-xeon-unnamed")
    assert pending.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "is no named kind: it owes every check of its vendor" in out
    assert " (owed by intel-xeon-unnamed;" in out


def test_the_list_names_what_a_kind_owes(capsys):
    assert pending.main(["--list", "--kind", "amd-epyc"]) == 0  # Zen 5: owes the first-level head prefetch alone
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert len(lines) == len(pending.CHECKS) + 1 and lines[-1].startswith("not timed by these checks")
    assert sum(" (owed by amd-epyc;" in line for line in lines) == 1


@pytest.mark.parametrize("argv, env, message", [
    (["--out", "{tmp}"], {"KVCACHE_OP_HEAD_PREFETCH": "l1"}, "unset KVCACHE_OP_HEAD_PREFETCH"),
    (["--out", "{tmp}"], {"KVCACHE_OP_CPU_KERNEL": "avx2"}, "unset KVCACHE_OP_CPU_KERNEL"),
    (["--out", "{tmp}", "--kind", "intel-xeon-207"], {}, "--kind names the kind to list for"),
    ([], {}, "--out is required"),
    (["--check", "no-such-check", "--out", "{tmp}"], {}, "invalid choice"),
    (["--out", "/proc/no/such/folder"], {}, "--out"),
    (["--list", "--kind", "AMD-EPYC"], {}, "--kind 'AMD-EPYC': a kind is intel-xeon-<model>"),
    (["--list", "--kind", "amd-epyc-zen5"], {}, "--kind 'amd-epyc-zen5'"),
])
def test_bad_command_lines_are_refused_in_one_line_before_any_work(argv, env, message, tmp_path, monkeypatch,
                                                                    capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        pending.main([a.format(tmp=tmp_path) for a in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr()
    assert message in err.err and err.err.count("\n") == 1 and err.out == ""
    assert not os.listdir(tmp_path)
