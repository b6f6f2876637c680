"""The todo web task: template files, the task statement the policy sees, and honest apps."""

from pathlib import Path

from rewards.code.grader import sha256

TEMPLATE = Path(__file__).resolve().parents[2] / "rewards" / "webdev" / "template"

STATEMENT = """Build a todo app in src/ (vanilla JS, Vite). Elements: input#new-todo, button#add-todo,
ul#todo-list with one li per todo containing span.text, input.toggle (checkbox) and button.delete, and
span#remaining with the number of todos not done. Add on button click or Enter (trimmed; blank ignored;
input cleared). Toggling marks the li with class "done". Delete removes the li.
"""


def template_files() -> dict:
    return {
        "package.json": (TEMPLATE / "package.json").read_text(),
        "package-lock.json": (TEMPLATE / "package-lock.json").read_text(),
        "vite.config.js": (TEMPLATE / "vite.config.js").read_text(),
        "TASK.md": STATEMENT,
    }


PROTECTED = {"TASK.md": sha256(STATEMENT)}

INDEX = """<!doctype html>
<html lang="en">
  <head><meta charset="UTF-8" /><title>Todos</title></head>
  <body>
    <div id="app"></div>
    <script type="module" src="/src/main.js"></script>
  </body>
</html>
"""

VANILLA = """import "./style.css";

const app = document.querySelector("#app");
app.innerHTML = `
  <input id="new-todo" placeholder="What needs doing?" />
  <button id="add-todo">Add</button>
  <ul id="todo-list"></ul>
  <p><span id="remaining">0</span> left</p>`;

const todos = [];
const input = document.querySelector("#new-todo");
const list = document.querySelector("#todo-list");

function render() {
  list.replaceChildren(
    ...todos.map((t, i) => {
      const li = document.createElement("li");
      li.className = t.done ? "done" : "";
      const box = document.createElement("input");
      box.type = "checkbox";
      box.className = "toggle";
      box.checked = t.done;
      box.addEventListener("change", () => { t.done = box.checked; render(); });
      const span = document.createElement("span");
      span.className = "text";
      span.textContent = t.text;
      const del = document.createElement("button");
      del.className = "delete";
      del.textContent = "x";
      del.addEventListener("click", () => { todos.splice(i, 1); render(); });
      li.append(box, span, del);
      return li;
    }),
  );
  document.querySelector("#remaining").textContent = String(todos.filter((t) => !t.done).length);
}

function add() {
  const text = input.value.trim();
  input.value = "";
  if (!text) return;
  todos.push({ text, done: false });
  render();
}

document.querySelector("#add-todo").addEventListener("click", add);
input.addEventListener("keydown", (e) => { if (e.key === "Enter") add(); });
render();
"""

STYLE = "li.done .text { text-decoration: line-through; }\nbody { font-family: sans-serif; }\n"

# slow but correct: every update lands after a delay (a debounced store)
SLOW = VANILLA.replace(
    "function render() {", "function render() { setTimeout(renderNow, 250); }\nfunction renderNow() {"
)

# unusual but correct: a tiny store + event delegation + markup from template strings, split over modules
STORE = """export function createStore() {
  let items = [];
  let nextId = 1;
  const subs = new Set();
  const emit = () => subs.forEach((f) => f(items));
  return {
    subscribe(f) { subs.add(f); f(items); },
    add(text) { items = [...items, { id: nextId++, text, done: false }]; emit(); },
    toggle(id) { items = items.map((t) => (t.id === id ? { ...t, done: !t.done } : t)); emit(); },
    remove(id) { items = items.filter((t) => t.id !== id); emit(); },
  };
}
"""
DELEGATED = """import { createStore } from "./store.js";

const esc = (s) => s.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
document.querySelector("#app").innerHTML =
  '<form id="f"><input id="new-todo"><button id="add-todo" type="submit">+</button></form>' +
  '<ul id="todo-list"></ul><footer>Remaining: <span id="remaining"></span></footer>';
const store = createStore();
const list = document.querySelector("#todo-list");
store.subscribe((items) => {
  list.innerHTML = items.map((t) =>
    `<li data-id="${t.id}" class="${t.done ? "done" : ""}">` +
    `<input class="toggle" type="checkbox" ${t.done ? "checked" : ""}>` +
    `<span class="text">${esc(t.text)}</span><button class="delete">delete</button></li>`).join("");
  document.querySelector("#remaining").textContent = items.filter((t) => !t.done).length;
});
document.querySelector("#f").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = document.querySelector("#new-todo");
  const text = input.value.trim();
  input.value = "";
  if (text) store.add(text);
});
list.addEventListener("click", (e) => {
  const id = Number(e.target.closest("li")?.dataset.id);
  if (e.target.matches(".toggle")) store.toggle(id);
  if (e.target.matches(".delete")) store.remove(id);
});
"""


def app(main=VANILLA, **extra) -> dict:
    files = {**template_files(), "index.html": INDEX, "src/main.js": main, "src/style.css": STYLE}
    files.update(extra)
    return files
