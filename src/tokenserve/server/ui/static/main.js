// Wires the header (tabs, API key) to the two views.
import { apiKey, clearError, setApiKey } from "./api.js";
import { Dashboard } from "./dashboard.js";
import { Playground } from "./playground.js";

const playground = new Playground();
const dashboard = new Dashboard();

function showView() {
  const name = location.hash === "#dashboard" ? "dashboard" : "playground";
  for (const view of ["playground", "dashboard"]) {
    document.getElementById(view).hidden = view !== name;
    document.getElementById(`tab-${view}`).classList.toggle("active", view === name);
  }
  dashboard.setVisible(name === "dashboard");
}

const keyField = document.getElementById("api-key");
keyField.value = apiKey();
keyField.addEventListener("change", () => {
  setApiKey(keyField.value.trim());
  clearError();
  playground.loadModels();
  dashboard.poll();
});

window.addEventListener("hashchange", showView);
showView();
playground.loadModels();
dashboard.start();
