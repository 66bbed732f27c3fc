// The page: two views behind tabs (#chat, #engine), and the API key asked for once when the
// server wants one. It holds no state of its own beyond the conversation and the key.

import { ApiError, apiKey, json } from "./api.js";
import { Chat } from "./chat.js";
import { EngineView } from "./engine.js";

const VIEWS = ["chat", "engine"];

function showView() {
  const current = VIEWS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "chat";
  for (const view of VIEWS) {
    document.getElementById(`${view}-view`).hidden = view !== current;
    document.getElementById(`tab-${view}`).setAttribute("aria-selected", String(view === current));
  }
}

// Resolves once a key is entered; the dialog shows why one is needed (the server's message).
function askKey(message) {
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key");
  document.getElementById("key-error").textContent = message;
  input.value = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      apiKey.set(input.value);
      resolve();
    }, { once: true });
  });
}

// The served models that chat (not embedding or reranking ones), asking for the key while the
// server refuses the one this tab has.
async function servedModels() {
  for (;;) {
    try {
      return (await json("/v1/models")).data.filter((m) => (m.task ?? "generate") === "generate")
        .map((m) => m.id);
    } catch (e) {
      if (!(e instanceof ApiError) || e.status !== 401) throw e;
      await askKey(apiKey.get() ? `The server refused this key: ${e.message}` : e.message);
    }
  }
}

async function start() {
  document.getElementById("key-dialog").addEventListener("cancel", (e) => e.preventDefault());
  if (matchMedia("(max-width: 720px)").matches) document.querySelector(".settings").open = false;
  window.addEventListener("hashchange", showView);
  showView();
  const chat = new Chat();
  const engine = new EngineView();
  try {
    const models = await servedModels();
    chat.setModels(models);
    document.getElementById("served-model").textContent = models.join(", ");
    engine.start();
  } catch (e) {
    chat.showError(`The server did not answer: ${e.message}`);
  }
}

start();
