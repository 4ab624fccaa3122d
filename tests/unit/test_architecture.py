"""The shape of the code, checked: layering, no import cycles, modules, classes and functions short enough to read.

Layers, lowest first (a module may import its own layer's package and the layers below, never above):

1. ``shared``: wire records, transport, configuration, the service skeleton; never a service.
2. ``weight_sync``: both halves of the weight push (torch, vLLM imported lazily); imports ``shared`` and itself.
   ``environments``: both halves of the environment protocol (no torch, no vLLM); imports ``shared`` and itself.
   The two are separate packages of one layer: neither imports the other.
3. ``services.generator``, ``services.scorer``, ``services.learner``, ``services.reward_plugin``,
   ``services.env_server`` and ``services.launcher``: each imports itself and ``shared`` only (services talk
   through the wire records, never through each other's code; what two of them must do alike, such as reading
   the data and importing reward functions for the learner, the scorer and the launcher's start-up check,
   lives in ``shared``); the generator and the learner, the two ends of a weight push, import ``weight_sync``
   too; the generator and the environment server, the two ends of the environment protocol, import
   ``environments``.

Every import counts, also one inside a function; only ``if TYPE_CHECKING:`` blocks are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("generator", "scorer", "learner", "reward_plugin", "env_server", "launcher")
WEIGHT_SYNC_USERS = ("services.generator", "services.learner")  # the two ends of a weight push
ENVIRONMENT_USERS = ("services.generator", "services.env_server")  # the two ends of the environment protocol
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 60
MAX_P90_FUNCTION_LINES = 25


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    packages = ("shared", "weight_sync", "environments", "services")
    files = [path for package in packages for path in sorted((ROOT / package).rglob("*.py"))]
    return {_module_name(path): path for path in files}


MODULES = _sources()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = importer.split(".")
    is_package = MODULES[importer].name == "__init__.py"
    base = package if is_package else package[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _project_target(name: str) -> str | None:
    """The project module an import names (``a.b.c`` may be a module or a name inside ``a.b``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> set[str]:
    """Project modules ``module`` imports (a ``from package import module`` names that module)."""
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            names = []
        for name in names:
            target = _project_target(name)
            if target is not None and target != module:
                found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def layer_of(module: str) -> tuple[int, str]:
    """(layer, package) of a project module."""
    parts = module.split(".")
    if parts[0] == "shared":
        return 1, "shared"
    if parts[0] in ("weight_sync", "environments"):
        return 2, parts[0]
    if len(parts) > 1 and parts[1] in SERVICES:
        return 3, f"services.{parts[1]}"
    return 0, module  # services/__init__.py: a namespace, imports nothing


def test_the_import_graph_is_read():
    assert "shared.config.pipeline" in GRAPH["shared.service"]
    assert len(GRAPH) > 60


def test_no_module_imports_a_layer_above_or_another_service():
    wrong = []
    for module, targets in GRAPH.items():
        layer, package = layer_of(module)
        for target in targets:
            target_layer, target_package = layer_of(target)
            if target_layer > layer or (target_layer == layer and target_package != package):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_a_service_importing_another_is_found():
    """The launcher's start-up check is a service like the others: importing the learner's code fails."""
    assert layer_of("services.launcher.preflight") == layer_of("services.launcher.cli")
    assert layer_of("services.launcher.preflight")[1] != layer_of("services.learner.data.feeder")[1]


def _reached_from(package: str) -> set[str]:
    """Every project module a module of ``package`` imports, directly or through others."""
    seen = {module for module in GRAPH if module.startswith(package)}
    todo = list(seen)
    while todo:
        for target in GRAPH[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


@pytest.mark.parametrize("service", ["services.scorer", "services.reward_plugin"])
def test_the_scorer_image_never_imports_the_prompt_data(service):
    """The scorer's image lacks ``datasets``, which ``shared.dataset`` needs to read a Hub or disk dataset."""
    reached = sorted(module for module in _reached_from(service) if module.startswith("shared.dataset"))
    assert not reached, reached


def test_only_the_generator_and_the_learner_import_weight_sync():
    """The scorer, the reward plugin and the launcher run without torch's weight push (the scorer's image
    does not even ship ``weight_sync``)."""
    wrong = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if layer_of(target)[1] == "weight_sync" and layer_of(module)[1] not in (*WEIGHT_SYNC_USERS, "weight_sync")
    ]
    assert not wrong, "\n".join(sorted(wrong))
    assert any(layer_of(t)[1] == "weight_sync" for m in GRAPH if m.startswith("services.learner") for t in GRAPH[m])


@pytest.mark.parametrize("layer", ["weight_sync", "environments"])
def test_a_middle_layer_imports_shared_and_itself_only(layer):
    wrong = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module.startswith(layer)
        for target in targets
        if layer_of(target)[1] not in ("shared", layer)
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_the_environment_protocol_reuses_the_chat_records():
    assert "shared.trajectory" in GRAPH["environments.protocol"]


def test_only_the_environment_protocols_two_ends_import_environments():
    """The scorer, the learner, the reward plugin and the launcher never open an environment session."""
    wrong = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if layer_of(target)[1] == "environments" and not module.startswith((*ENVIRONMENT_USERS, "environments"))
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_environments_imports_neither_torch_nor_vllm():
    """The environment server and a CPU generator's environment client run without torch or vLLM installed."""
    heavy = []
    for module, path in MODULES.items():
        if not module.startswith("environments"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            heavy += [f"{module}: {name}" for name in names if name.split(".")[0] in ("torch", "vllm")]
    assert not heavy, heavy


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_there_are_no_import_cycles():
    assert _cycles(GRAPH) == []


def definition_lengths(kinds: tuple[type[ast.AST], ...]) -> dict[str, int]:
    """``path:line name`` -> lines, for every definition of ``kinds`` in the product code."""
    out = {}
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kinds):
                out[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    return out


def function_lengths() -> dict[str, int]:
    """``path:line name`` -> lines, for every function and method of the product code."""
    return definition_lengths((ast.FunctionDef, ast.AsyncFunctionDef))


def _over(lengths: dict[str, int], limit: int) -> str:
    """The definitions longer than ``limit`` lines, longest first, one per line (empty when none)."""
    return "\n".join(f"{n:5} {name}" for name, n in sorted(lengths.items(), key=lambda i: -i[1]) if n > limit)


def test_no_module_is_over_five_hundred_lines():
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in MODULES.values()}
    long = _over(lengths, MAX_MODULE_LINES)
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n{long}"


def test_no_class_is_over_two_hundred_fifty_lines():
    long = _over(definition_lengths((ast.ClassDef,)), MAX_CLASS_LINES)
    assert not long, f"classes over {MAX_CLASS_LINES} lines:\n{long}"


def test_no_function_is_over_sixty_lines():
    long = _over(function_lengths(), MAX_FUNCTION_LINES)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n{long}"


def test_ninety_percent_of_functions_are_twenty_five_lines_or_shorter():
    lengths = sorted(function_lengths().values())
    p90 = lengths[int(0.9 * (len(lengths) - 1))]
    assert p90 <= MAX_P90_FUNCTION_LINES, f"90th percentile {p90} lines over {len(lengths)} functions"


# File names the house style repeats on purpose: each is a role every package or service has, so a reader who
# knows one knows all; any other name means one concept in the whole tree.
ROLE_FILE_NAMES = {
    "__init__.py": "a package",
    "__main__.py": "a service's wiring (python -m services.X)",
    "app.py": "a service's thin FastAPI shell (shared/app.py builds them)",
    "startup.py": "what a service checks and builds before it serves",
    "cli.py": "a command line's arguments (asyncgrpo, the reward plugin's)",
    "protocol.py": "the records of one byte-exact protocol (weight_sync's push, environments' sessions)",
}


def repeated_file_names(paths: list[Path]) -> dict[str, list[str]]:
    """File name -> its paths, for the names more than one module has and ``ROLE_FILE_NAMES`` does not list."""
    by_name: dict[str, list[str]] = {}
    for path in paths:
        by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    return {name: sorted(found) for name, found in by_name.items() if len(found) > 1 and name not in ROLE_FILE_NAMES}


def test_no_two_modules_share_a_file_name():
    """One name per concept: two ``placement.py`` with different meanings cost every reader a lookup."""
    repeated = repeated_file_names(list(MODULES.values()))
    assert not repeated, "\n".join(f"{name}: {', '.join(paths)}" for name, paths in sorted(repeated.items()))


def test_the_file_name_check_finds_a_repeat():
    paths = [ROOT / "shared" / "x.py", ROOT / "weight_sync" / "x.py", ROOT / "a" / "app.py", ROOT / "b" / "app.py"]
    assert repeated_file_names(paths) == {"x.py": ["shared/x.py", "weight_sync/x.py"]}


def redeclared_fields(classes: list[type]) -> list[str]:
    """``Class.field`` for each settings field a class declares again over a base's, unless its ``OVERRIDES``
    gives the reason, and for each field two of its bases declare where neither inherits the other."""
    return [problem for cls in classes for problem in _redeclared_over_bases(cls) + _declared_by_siblings(cls)]


def _declared(cls: type) -> set[str]:
    return set(vars(cls).get("__annotations__", {}))


def _redeclared_over_bases(cls: type) -> list[str]:
    own = _declared(cls) & set(cls.model_fields)  # fields, not ClassVars
    found = []
    for base in cls.__mro__[1:]:
        inherited = own & _declared(base) - set(getattr(cls, "OVERRIDES", {}))
        found += [f"{cls.__name__}.{name} (also {base.__name__}'s)" for name in sorted(inherited)]
    return found


def _declared_by_siblings(cls: type) -> list[str]:
    """Fields two bases of ``cls`` declare, neither a subclass of the other (``LearnerSettings`` combines
    ``BatchSettings``, ``UpdateSettings``, ...): the MRO keeps one default in silence, so no reason can be given."""
    found = []
    for name in sorted(cls.model_fields):
        owners = [base for base in cls.__mro__ if name in _declared(base)]
        found += [
            f"{cls.__name__}.{name} (declared by {a.__name__} and by {b.__name__})"
            for i, a in enumerate(owners)
            for b in owners[i + 1 :]
            if not issubclass(a, b) and not issubclass(b, a)
        ]
    return found


def test_no_settings_field_is_declared_twice():
    """A setting is declared once, with one default; a service declares it again only with its reason."""
    from shared.config.generator import GeneratorSettings
    from shared.config.learner import LearnerSettings
    from shared.config.scorer import ScorerSettings

    assert not redeclared_fields([GeneratorSettings, ScorerSettings, LearnerSettings])
    for name in ("host", "max_request_bytes", "api_docs"):
        assert name not in vars(ScorerSettings).get("__annotations__", {})


def test_the_redeclaration_check_finds_one():
    from pydantic import BaseModel

    class Base(BaseModel):
        port: int = 1

    class Service(Base):
        port: int = 2

    assert redeclared_fields([Service]) == ["Service.port (also Base's)"]


def test_the_redeclaration_check_finds_one_in_two_sibling_groups():
    from pydantic import BaseModel

    class Batch(BaseModel):
        steps: int = 1

    class Update(BaseModel):
        steps: int = 2

    class Service(Batch, Update):
        pass

    assert redeclared_fields([Service]) == ["Service.steps (declared by Batch and by Update)"]


def test_the_size_checks_find_an_offender():
    assert _over({"a.py:1 long": 61, "a.py:9 short": 60}, 60) == "   61 a.py:1 long"


@pytest.mark.parametrize("service", ["generator", "scorer", "learner"])
def test_each_service_main_is_wiring_only(service):
    lines = (ROOT / "services" / service / "__main__.py").read_text().splitlines()
    assert len(lines) <= 40, f"services/{service}/__main__.py has {len(lines)} lines"


def test_weight_sync_imports_vllm_only_inside_functions():
    """The learner imports ``weight_sync`` without vLLM installed (a GPU learner needs it for NCCL alone)."""
    eager = []
    for module, path in MODULES.items():
        if not module.startswith("weight_sync"):
            continue
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            eager += [f"{module}: {name}" for name in names if name.split(".")[0] == "vllm"]
    assert not eager, eager
