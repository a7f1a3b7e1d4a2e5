"""A class on Kubernetes (hub/k8s/), checked as far as can be without a cluster or a container engine:
the Helm values name only keys the official chart defines (its values.schema.json of 4.4.0, over its
default values, as Helm validates a release), the roles' hook gives each role its image and settings,
the student image holds nothing of the instructor's, and the grader's Job is the one privileged pod."""

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import jsonschema
import yaml

from .conftest import REPO

K8S = REPO / "hub" / "k8s"
CHART = K8S / "z2jh-4.4.0"
SECRET = ("solutions", "autograder", "tests", "hub/k8s")  # what no student may have in their image


def merged(base, over):
    """Helm's merge of a release's values over a chart's defaults: maps merged, anything else replaced,
    null removes the default."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merged(base.get(key), value)
        return out
    return over


def chart_errors(values):
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = validator.iter_errors(merged(defaults, values))
    return [f"{'.'.join(map(str, e.path))}: {e.message[:200]}" for e in errors]


def values():
    return yaml.safe_load((K8S / "values.yaml").read_text())


def test_the_helm_values_name_only_keys_the_chart_defines():
    assert chart_errors(values()) == []
    misspelt = values()
    misspelt["singleuser"]["memroy"] = {"limit": "3G"}  # a key the chart does not know must be caught
    assert any("memroy" in error for error in chart_errors(misspelt)), chart_errors(misspelt)


def test_each_role_gets_its_image_and_its_configuration():
    """hub.extraConfig's hook, run on stand-ins of KubeSpawner: the instructor's server gets the instructor
    image, the course's configuration and the course root's volume; a student's, the student image and
    the student's configuration only."""
    code = values()["hub"]["extraConfig"]["dpcourse-roles.py"]
    c = types.SimpleNamespace(KubeSpawner=types.SimpleNamespace())
    exec(compile(code, "dpcourse-roles.py", "exec"), {"c": c})
    hook = c.KubeSpawner.pre_spawn_hook
    image = f"{values()['singleuser']['image']['name']}:{values()['singleuser']['image']['tag']}"
    spawners = {}
    for name in ("teacher", "student-a"):
        spawner = types.SimpleNamespace(user=types.SimpleNamespace(name=name), environment={}, image=image,
                                        volumes=[], volume_mounts=[])
        hook(spawner)
        spawners[name] = spawner
    teacher, student = spawners["teacher"], spawners["student-a"]
    assert teacher.image.endswith(":instructor") and student.image == image
    assert teacher.environment["JUPYTER_CONFIG_PATH"].endswith("/srv/dpcourse/autograder")
    assert student.environment["JUPYTER_CONFIG_PATH"] == "/srv/dpcourse/config/student"
    assert student.volumes == [] and [v["name"] for v in teacher.volumes] == ["course-root"]
    for spawner in (teacher, student):
        assert spawner.environment["DPCOURSE_EXCHANGE_KIND"] == "ngshare"
    assert (REPO / "hub" / "config" / "student" / "nbgrader_config.py").exists()


def stages():
    """{stage: [COPY source, ...]} of hub/k8s/Dockerfile, and each stage's base."""
    found, bases, stage = {}, {}, None
    for line in (K8S / "Dockerfile").read_text().splitlines():
        start = re.match(r"FROM (\S+) AS (\S+)", line)
        if start:
            stage = start.group(2)
            bases[stage] = start.group(1)
            found[stage] = []
        elif line.startswith("COPY") and stage:
            found[stage].extend(word for word in line.split()[1:-1] if not word.startswith("--"))
    return found, bases


def test_the_student_image_holds_nothing_of_the_instructors():
    copies, bases = stages()
    assert set(copies) == {"student", "instructor", "ngshare"} and bases["instructor"] == "student"
    for stage, sources in copies.items():
        for source in sources:
            assert (REPO / source).exists(), f"{stage} copies {source}, which is not in the repository"
    for source in copies["student"]:
        assert not source.rstrip("/").startswith(SECRET), f"the student image copies {source}"
    assert {"solutions/", "autograder/"} <= set(copies["instructor"])


def test_the_package_built_without_autograder_is_dpcourse_only(tmp_path):
    """The student image installs the course's package from pyproject.toml and course/ alone: what it
    builds must hold dpcourse and nothing of dpgrader (the hidden checks)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (tmp_path / "src" / "course").symlink_to(REPO / "course")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(tmp_path / "src")],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    import zipfile

    (wheel,) = (tmp_path / "dist").glob("*.whl")
    packages = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert "dpcourse" in packages and not any(p.startswith("dpgrader") for p in packages), packages


def test_the_grader_job_is_the_one_privileged_pod_and_runs_the_course_grader():
    documents = [d for d in yaml.safe_load_all((K8S / "grading.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in documents}
    assert set(kinds) == {"PersistentVolumeClaim", "Job"}
    job = kinds["Job"]
    assert "ASSIGNMENT" in job["metadata"]["name"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["securityContext"]["privileged"] is True and container["image"].endswith(":instructor")
    script = container["args"][0]
    for step in ("nbgrader collect ASSIGNMENT", "autograde", "report", "release_feedback ASSIGNMENT"):
        assert step in script, step
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DPCOURSE_EXCHANGE_KIND"] == "ngshare" and "DPCOURSE_GRADING_SOCKET" not in env
    assert kinds["PersistentVolumeClaim"]["metadata"]["name"] in json.dumps(job)
    assert "privileged" not in (K8S / "values.yaml").read_text()  # no user's server is
    ngshare = yaml.safe_load((K8S / "ngshare-values.yaml").read_text())
    assert ngshare["ngshare"]["hub_api_token"] == values()["hub"]["services"]["ngshare"]["apiToken"]
    assert Path(REPO / "hub" / "ngshare_service.py").exists()
