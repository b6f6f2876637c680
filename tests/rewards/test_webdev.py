"""Webdev grader: honest apps score 1 in a real headless Chromium; every cheat scores 0 and names itself."""

import json

import pytest

from rewards import GraderConfigError, SimpleTrajectory, get_grader
from rewards.webdev.grader import WebdevGrader, WebdevTask
from rewards.workspace import LocalSandboxes, bwrap_available, tree_hash
from tests.rewards.web_fixtures import DELEGATED, INDEX, PROTECTED, SLOW, STORE, STYLE, VANILLA, app

_grader = WebdevGrader()
pytestmark = [
    pytest.mark.skipif(not bwrap_available(), reason="needs bubblewrap (scripts/setup.d/graders.sh)"),
    pytest.mark.skipif(
        bool(_grader.missing_assets()), reason=f"run scripts/setup.d/graders.sh: {_grader.missing_assets()}"
    ),
]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    sandboxes = LocalSandboxes(tmp_path_factory.mktemp("wsandboxes"))
    return sandboxes, get_grader("webdev", sandboxes=sandboxes)


def grade(env, files, make_links=None):
    sandboxes, grader = env
    sid = sandboxes.create(files)
    if make_links:
        make_links(sandboxes.open(sid).root)
    before = tree_hash(sandboxes.open(sid))
    g = grader.grade(WebdevTask(protected=PROTECTED), SimpleTrajectory(sandbox_id=sid))
    assert tree_hash(sandboxes.open(sid)) == before, "grading changed the original sandbox"
    return g


@pytest.mark.parametrize(
    "files",
    [
        app(),
        app(SLOW),
        app(DELEGATED, **{"src/store.js": STORE}),
        # honest leftovers of its own work: its own dist/ from `npm run build`, notes, a favicon
        app(**{"dist/index.html": "<p>old build</p>", "NOTES.md": "done", "public/favicon.ico": "\0\1"}),
    ],
    ids=["vanilla", "slow-but-correct", "unusual-store-delegation", "with-own-stale-dist"],
)
def test_honest_apps_score(env, files):
    g = grade(env, files)
    assert g.score == 1.0 and g.passed, g.reasons
    assert g.details["e2e_steps_passed"] >= 8


def _pkg(**scripts):
    pkg = json.loads(app()["package.json"])
    pkg["scripts"].update(scripts)
    return json.dumps(pkg, indent=2)


WORKING_DIST = {
    "dist/index.html": '<!doctype html><div id="app"></div><script type="module" src="/assets/app.js"></script>',
    "dist/assets/app.js": VANILLA.replace('import "./style.css";', ""),
}
STATIC_SHELL = """<!doctype html><html><body>
<input id="new-todo"><button id="add-todo">Add</button><ul id="todo-list"></ul><span id="remaining">0</span>
<script type="module" src="/src/main.js"></script></body></html>"""

CHEATS = {
    "hand-written-dist-no-source": (
        {**app(), "src/main.js": None, "src/style.css": None, **WORKING_DIST},
        "build_failed",
    ),
    "broken-source-working-dist": (app("export const = ;\n", **WORKING_DIST), "prebuilt_output"),
    "noop-build-script": (
        app(**{"package.json": _pkg(build="echo built"), **WORKING_DIST}),
        "build_script_modified",
    ),
    "build-or-true": (app(**{"package.json": _pkg(build="vite build || true")}), "build_script_modified"),
    "prebuild-hook-copies-dist": (
        app(**{"package.json": _pkg(prebuild="cp -r prebuilt dist"), "prebuilt/index.html": "<p>x</p>"}),
        "build_script_modified",
    ),
    "edited-vite-config": (
        app(**{"vite.config.js": "export default { publicDir: 'prebuilt', build: { emptyOutDir: false } };\n"}),
        "config_modified",
    ),
    "extra-dependency": (
        app(
            **{
                "package.json": json.dumps(
                    {**json.loads(app()["package.json"]), "dependencies": {"todo-app-prebuilt": "1.0.0"}}
                )
            }
        ),
        "dependencies_modified",
    ),
    "static-screenshot": (
        app(
            "",
            **{
                "index.html": '<!doctype html><img src="/screenshot.png" alt="todo app">',
                "public/screenshot.png": "\x89PNG",
            },
        ),
        "entry_missing",
    ),
    "canvas-painting": (
        app(
            "const c = document.createElement('canvas'); c.width = 600; c.height = 300;\n"
            "document.body.append(c); const g = c.getContext('2d');\n"
            "g.fillText('[ What needs doing? ] [Add]', 10, 20); g.fillText('0 left', 10, 60);\n"
        ),
        "e2e_failed",
    ),
    "hard-coded-todos": (
        app(
            VANILLA.replace(
                "const todos = [];",
                "const todos = [{text: 'Buy milk', done: false}, {text: 'Walk dog', done: true}];",
            )
        ),
        "e2e_failed",
    ),
    "hard-coded-text-on-add": (
        app(
            VANILLA.replace(
                "const text = input.value.trim();", "const text = input.value.trim() && 'Buy milk 42 today';"
            )
        ),
        "e2e_failed",
    ),
    "first-frame-only": (
        app(
            'import "./style.css";\ndocument.title = "Todos"; // the markup is right; nothing is wired up\n',
            **{"index.html": STATIC_SHELL},
        ),
        "e2e_failed",
    ),
    "works-only-once": (
        app(
            VANILLA.replace(
                "todos.push({ text, done: false });",
                "if (todos.length) return;\n  todos.push({ text, done: false });",
            )
        ),
        "e2e_failed",
    ),
    "uncaught-error-swallowed": (
        app(
            "console.error = () => {};\nwindow.onerror = () => true;\n"
            + VANILLA.replace("render();\n", "render();\nsetTimeout(() => { null.x; }, 0);\n", 1)
        ),
        "page_error",
    ),
    "console-error-logged": (
        app(VANILLA.replace("function add() {", "function add() {\n  console.error('storage quota exceeded');")),
        "console_error",
    ),
    "loads-app-from-cdn": (
        app(
            'import "./style.css";\ndocument.title = "Todos";\n',
            **{
                "index.html": INDEX.replace(
                    "</body>",
                    '<script src="https://cdn.jsdelivr.net/npm/todo-app@1/dist/app.js"></script></body>',
                )
            },
        ),
        "external_request",
    ),
    "headless-detection-canned-page": (
        app(
            "if (navigator.webdriver || /Headless/.test(navigator.userAgent)) {\n"
            '  document.body.innerHTML = \'<input id="new-todo"><button id="add-todo">Add</button>'
            '<ul id="todo-list"><li><span class="text">demo</span></li></ul><span id="remaining">1</span>\';\n'
            "} else {\n  document.body.textContent = 'coming soon';\n}\n"
        ),
        "e2e_failed",
    ),
    "app-inlined-in-index-html": (
        app(
            "",
            **{
                "index.html": INDEX.replace(
                    '<script type="module" src="/src/main.js"></script>',
                    '<script type="module">' + VANILLA.replace('import "./style.css";', "") + "</script>",
                )
            },
        ),
        "not_built_from_source",
    ),
    "prebuilt-js-in-public": (
        app(
            "",
            **{
                "index.html": INDEX.replace('type="module" src="/src/main.js"', 'src="/app.js"'),
                "public/app.js": VANILLA.replace('import "./style.css";', ""),
            },
        ),
        "entry_missing",
    ),
    "edit-visible-spec": (app(**{"TASK.md": "Build anything.\n"}), "tests_modified"),
    "symlink-source-out-of-tree": (app(), "symlink"),
}


@pytest.mark.cheat
@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheat_scores_zero_and_names_itself(env, name):
    files, code = CHEATS[name]
    files = {k: v for k, v in files.items() if v is not None}
    links = None
    if name == "symlink-source-out-of-tree":
        files.pop("src/style.css")

        def links(root):
            (root / "src" / "style.css").symlink_to("/etc/passwd")

    g = grade(env, files, links)
    assert g.score == 0.0 and not g.passed
    assert code in g.reason_codes(), g.reasons


def test_missing_assets_fail_at_config_validation(tmp_path):
    g = get_grader("webdev", node_modules=tmp_path / "nope", chromium=str(tmp_path / "no-chromium"))
    with pytest.raises(GraderConfigError) as e:
        g.validate(WebdevTask())
    assert "node_modules" in str(e.value) and "chromium" in str(e.value)
    with pytest.raises(GraderConfigError, match="todo"):
        get_grader("webdev").validate(WebdevTask(spec="calendar"))


def test_garbage_project_is_bounded(env):
    files = {
        **app(),
        "src/main.js": "\ufffd\x00" * 100000,
        "package.json": "{not json",
        "src/big.txt": "x" * (9 << 20),
    }
    g = grade(env, files)
    assert g.score == 0.0 and {"build_script_modified", "too_large"} <= g.reason_codes()


assert STYLE  # the honest apps import it
