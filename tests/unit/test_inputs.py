"""The simulator's inputs: the Philly trace, fleet and projects files, and bad input."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from gpufleet.scheduler.errors import InputError
from gpufleet.scheduler.inputs import TraceJob, read_fleet, read_projects, read_trace
from gpufleet.scheduler.model import Quota, project_tree

PHILLY = Path(__file__).resolve().parents[2].parent / "shared/traces/philly-2017-10-02-5k.csv"


@pytest.mark.skipif(not PHILLY.exists(), reason="../shared/traces is not beside the checkout")
def test_the_philly_window_reads_as_its_readme_describes() -> None:
    jobs = read_trace(PHILLY)
    assert len(jobs) == 5000
    assert Counter(j.num_gpus for j in jobs) == {1: 4743, 2: 66, 4: 55, 8: 123, 16: 2, 32: 11}
    assert len({j.group for j in jobs}) == 9
    assert jobs[0] == TraceJob("0", 0.0, 108.0, 1, "11cb48")
    assert 3.0 < max(j.submit_s for j in jobs) / 86400 < 3.2
    gpu_hours = sum(j.duration_s * j.num_gpus for j in jobs) / 3600
    assert 45_000 < gpu_hours < 49_000


def test_optional_columns(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "job_id,submit_s,duration_s,num_gpus,group,kind,priority,gpu_type,gpus_per_pod\n"
        "a,0,60,16,vision,job,critical,H100-80GB,8\n"
        "b,5.5,30,1,nlp,session,,,\n"
    )
    assert read_trace(trace) == [
        TraceJob("a", 0.0, 60.0, 16, "vision", "job", "critical", "H100-80GB", 8),
        TraceJob("b", 5.5, 30.0, 1, "nlp", "session"),
    ]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ("job_id,submit_s,num_gpus,group\n", "lacks the column(s) duration_s"),
        (
            "job_id,submit_s,duration_s,num_gpus,group\na,0,10,two,g\n",
            "t.csv:2: num_gpus must be a whole number, not 'two'",
        ),
        (
            "job_id,submit_s,duration_s,num_gpus,group\na,0,10,0,g\n",
            "t.csv:2: num_gpus must be positive",
        ),
        (
            "job_id,submit_s,duration_s,num_gpus,group\na,0,-5,1,g\n",
            "t.csv:2: duration_s must be a number of seconds more than 0 up to 1e10",
        ),
        (
            "job_id,submit_s,duration_s,num_gpus,group\na,0,5,1,g\na,1,5,1,g\n",
            "t.csv:3: job_id must be present and unique",
        ),
        (
            "job_id,submit_s,duration_s,num_gpus,group,kind\na,0,5,1,g,batch\n",
            "kind must be session or job",
        ),
    ],
)
def test_bad_traces_say_where_and_what(tmp_path: Path, rows: str, message: str) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(rows)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_trace(trace)


HEADER = "job_id,submit_s,duration_s,num_gpus,group\n"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("a,0,nan,1,g", "duration_s must be a number of seconds more than 0 up to 1e10"),
        ("a,0,inf,1,g", "duration_s must be a number of seconds more than 0 up to 1e10"),
        ("a,0,1e400,1,g", "duration_s must be a number of seconds more than 0 up to 1e10"),
        ("a,0,0,1,g", "duration_s must be a number of seconds more than 0 up to 1e10"),
        ("a,0,1e11,1,g", "duration_s must be a number of seconds more than 0 up to 1e10"),
        ("a,nan,5,1,g", "submit_s must be a number of seconds from 0 up to 1e10"),
        ("a,-1,5,1,g", "submit_s must be a number of seconds from 0 up to 1e10"),
        ("a,-inf,5,1,g", "submit_s must be a number of seconds from 0 up to 1e10"),
        ("a,0,5,-1,g", "num_gpus must be positive, not '-1'"),
        ("a,0,5,+1,g", "num_gpus must be a whole number, not '+1'"),
        ("a,0,5,\u0661,g", "num_gpus must be a whole number, not '\u0661'"),
        ("a,0,5," + "9" * 5000 + ",g", "num_gpus must be a whole number of at most 16 digits"),
    ],
    ids=[
        "nan",
        "inf",
        "1e400",
        "zero",
        "past-1e10",
        "submit-nan",
        "submit-negative",
        "submit-inf",
        "gpus-negative",
        "gpus-plus",
        "gpus-arabic-digit",
        "gpus-5000-digits",
    ],
)
def test_a_time_or_count_that_is_no_plain_number_is_refused_with_its_line(
    tmp_path: Path, row: str, message: str
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + "a0,0,5,1,g\n" + row + "\n")
    with pytest.raises(InputError) as caught:
        read_trace(trace)
    assert str(caught.value).startswith(f"{trace}:3: {message}")
    assert len(str(caught.value)) < 200  # a 5,000-digit value is not echoed whole


def test_times_at_the_bounds_are_read(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + "a,0,1e-3,1,g\nb,1e10,1e10,1,g\n")
    assert [(j.submit_s, j.duration_s) for j in read_trace(trace)] == [
        (0.0, 0.001),
        (1e10, 1e10),
    ]


def test_a_byte_order_mark_before_the_header_is_dropped(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_bytes(b"\xef\xbb\xbf" + (HEADER + "a,0,5,1,g\n").encode())
    assert read_trace(trace) == [TraceJob("a", 0.0, 5.0, 1, "g")]


def test_a_trace_that_is_not_utf8_names_the_line_of_the_first_bad_byte(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_bytes((HEADER + "a,0,5,1,g\n").encode() + b"b,0,5,1,r\xe9seau\n")
    with pytest.raises(InputError, match=r"t\.csv:3: not UTF-8 text \(byte 0xe9\); save the"):
        read_trace(trace)


def test_a_field_past_what_the_csv_reader_holds_is_an_input_error(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + "a,0,5,1," + "g" * 200_000 + "\n")
    with pytest.raises(InputError, match=r"t\.csv:2: not CSV as the trace needs it: field larger"):
        read_trace(trace)


def test_fleet_file(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "clusters:\n"
        "  - name: east\n"
        "    zones:\n"
        "      - name: a\n"
        "        pools:\n"
        "          - {name: big, count: 2, gpus_per_node: 8, gpu_type: H100-80GB,\n"
        "             labels: {network: ib}}\n"
        "      - name: b\n"
        "        pools: [{count: 1, gpus_per_node: 4, gpu_type: A100-80GB}]\n"
    )
    nodes = read_fleet(fleet)
    assert [(n.name, n.cluster, n.zone, n.gpu_type, n.gpus) for n in nodes] == [
        ("big-0", "east", "a", "H100-80GB", 8),
        ("big-1", "east", "a", "H100-80GB", 8),
        ("east-b-0-0", "east", "b", "A100-80GB", 4),
    ]
    assert nodes[0].labels == {"network": "ib"}
    fleet.write_text("clusters:\n  - zones: [{pools: [{count: 0, gpus_per_node: 8}]}]\n")
    with pytest.raises(InputError, match="count must be a whole number >= 1"):
        read_fleet(fleet)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "clusters:\n  - name: c\n    zones:\n      - name: z1\n"
            "        nodes: [{name: n, count: 6, gpu_type: V100, gpus: 8}]\n",
            "cluster c, zone 0: unknown zone key(s) nodes; a zone has name, pools",
        ),
        (
            "clusters:\n  - zones: [{pools: [{count: 2, gpus: 8, gpu_type: V100}]}]\n",
            "unknown pool key(s) gpus; a pool has count, gpu_type, gpus_per_node",
        ),
        ("clusters:\n  - name: c\n", "the fleet has no nodes"),
    ],
)
def test_a_fleet_file_that_names_no_nodes_says_what_to_fix(
    tmp_path: Path, text: str, message: str
) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(text)
    with pytest.raises(InputError, match=re.escape(message)):
        read_fleet(fleet)


def test_projects_file_is_the_config_shape(tmp_path: Path) -> None:
    projects = tmp_path / "projects.yaml"
    projects.write_text(
        "projects:\n"
        "  - {name: research, kind: organisation,\n"
        "     quotas: {A100-80GB: {guaranteed: 0, borrow_limit: 16}}}\n"
        "  - {name: vision, parent: research, weight: 2, per_user_gpu_cap: 4,\n"
        "     quotas: {A100-80GB: {guaranteed: 8, lend_limit: 4}}}\n"
        "  - {name: nlp, parent: research}\n"
    )
    tree = read_projects(projects)
    assert tree.projects["vision"].quotas["A100-80GB"] == Quota(8, None, 4)
    assert tree.projects["research"].quotas["A100-80GB"] == Quota(0, 16, None)
    assert tree.ancestors("vision") == ("research",)
    assert tree.children("research") == ("vision", "nlp")
    assert tree.projects["vision"].weight == 2.0 and tree.projects["vision"].per_user_cap == 4


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([{"name": "a", "parent": "b"}], "names parent 'b', which is not declared before it"),
        ([{"name": "a"}, {"name": "a"}], "declared twice"),
        (
            [{"name": "a", "quotas": {"A100": {"guaranteed": -1}}}],
            "guaranteed must be a whole number of at least 0",
        ),
        ([{"name": "a", "quotas": {"A100": {"guarantee": 4}}}], "unknown quota field"),
        ([{"name": "a", "weight": 0}], "weight must be a positive number"),
        ([{"name": "a", "kind": "division"}], "kind must be one of"),
        ([{"name": "a", "per_user_gpu_cap": 0}], "per_user_gpu_cap"),
    ],
)
def test_bad_project_declarations(specs: list[dict[str, object]], message: str) -> None:
    with pytest.raises(InputError, match=message):
        project_tree(specs)
