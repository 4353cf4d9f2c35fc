// The page's one way to call the server: same origin, with the API key (if any) from
// sessionStorage, and OpenAI error bodies turned into ApiError.

const KEY_STORAGE = "tokenserve.apiKey";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

export async function apiFetch(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  let response;
  try {
    response = await fetch(path, { ...options, headers });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(0, `cannot reach the server (${error.message})`);
  }
  if (!response.ok) throw await errorOf(response);
  return response;
}

async function errorOf(response) {
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    message = (body.error && body.error.message) || body.error || JSON.stringify(body);
  } catch (_) { /* not JSON: keep the status text */ }
  return new ApiError(response.status, String(message));
}

export function describe(error) {
  if (!(error instanceof ApiError)) return String(error.message || error);
  const hint = error.status === 401 ? " Enter a valid API key at the top right." : "";
  const message = error.message.replace(/[.\s]+$/, "");
  return error.status ? `HTTP ${error.status}: ${message}.${hint}` : message;
}

export function showError(error) {
  const box = document.getElementById("error");
  box.textContent = describe(error);
  box.hidden = false;
}

export function clearError() {
  const box = document.getElementById("error");
  box.textContent = "";
  box.hidden = true;
}
