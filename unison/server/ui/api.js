// The server's routes as the page calls them: every call sends the API key (kept in this tab's
// sessionStorage), and every failure is an ApiError carrying the server's own message.

const KEY = "unison.apiKey";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export const apiKey = {
  get: () => sessionStorage.getItem(KEY),
  set: (key) => sessionStorage.setItem(KEY, key),
};

export async function api(path, { method = "GET", body, signal } = {}) {
  const headers = {};
  const key = apiKey.get();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok) throw new ApiError(response.status, await errorMessage(response));
  return response;
}

export async function json(path, options) {
  return (await api(path, options)).json();
}

// OpenAI's error shape ({"error": {"message": ...}}), SGLang's ({"success": false, "message": ...}),
// else whatever the body says.
async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return body.error?.message ?? body.message ?? text;
  } catch {
    return text || `${response.status} ${response.statusText}`;
  }
}

// The JSON payloads of a server-sent-events body, up to [DONE]. An error reported inside the
// stream (after the 200) is thrown as an ApiError.
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      if (!data) continue;
      const event = JSON.parse(data);
      if (event.error) throw new ApiError(event.error.code, event.error.message);
      yield event;
    }
  }
}
