// chunkline demo page: controller and viewer of a world-model stream.
//
// Plain ES module, no framework, no build step. Two transports:
//  - local (default): the server's own rooms over WebSocket at `websocket_path?token=...`.
//    Text frames are JSON ({"type":"data","topic","payload","from"}, joined, participant_joined/left,
//    refused); binary frames are media: "V" + JPEG, or "A" + u32le sample rate + u16le channels + PCM16.
//  - livekit: the livekit-client SDK, vendored at /static/vendor/livekit-client.umd.js (see
//    vendor/README.md); loaded on demand, never from a CDN.
//
// Viewer mode: open `/?session=<id>&room=<room>&token=<token>&ws=<websocket_path>` (or `&lk=<url>`
// for LiveKit). A viewer sees the same video and status but has no controls.
//
// No import/export statements on purpose: the file also parses as a classic script (`node --check`).

"use strict";

const CONTROL_TOPIC = "tf.control";
const STATUS_TOPIC = "tf.status";
const METRICS_TOPIC = "tf.metrics";
const HEARTBEAT_MS = 1000;
const POLL_MS = 1000;
const SESSION_REFRESH_MS = 3000;
const LOG_LIMIT = 60;
const LIVEKIT_BUNDLE = "/static/vendor/livekit-client.umd.js";
const STATS_PERIOD_MS = 250; // how often LiveKit mode reads the decoder's frame count
const TERMINAL = new Set(["closed", "failed", "expired", "rejected"]);
const WAITING = new Set(["pending", "queued"]); // admitted but not yet given a worker
// Session states (states/stream_session.py); a tf.status "status" stage with one of these names is the
// session's new state, shown at once instead of at the next refresh.
const SESSION_STATES = new Set([
  "pending", "queued", "assigned", "joining_room", "starting_pipeline", "running", "draining",
  "closed", "failed", "expired", "rejected",
]);
// The server's own publisher in a room is `chunkline-<worker_id>` (server/runner.py): not a person.
const SERVER_IDENTITY_PREFIX = "chunkline-";
const SERVER_STATUS_IDENTITY = `${SERVER_IDENTITY_PREFIX}server`; // server/tokens.py: the server's own word

// KeyboardEvent.code -> the normalized key the server expects (pipelines/contract.py KNOWN_KEYS).
const KEY_CODES = {
  KeyW: "w", KeyA: "a", KeyS: "s", KeyD: "d",
  KeyI: "i", KeyJ: "j", KeyK: "k", KeyL: "l",
  ArrowUp: "w", ArrowDown: "s", ArrowLeft: "a", ArrowRight: "d",
};
const KEY_ORDER = ["w", "a", "s", "d", "i", "j", "k", "l"];

const $ = (id) => document.getElementById(id);

const ui = {
  badge: $("mode-badge"),
  frame: $("frame"),
  lkVideo: $("lk-video"),
  lkAudio: $("lk-audio"),
  placeholder: $("placeholder"),
  placeholderText: $("placeholder-text"),
  screen: $("screen"),
  endBanner: $("end-banner"),
  stage: $("stat-stage"),
  status: $("stat-status"),
  fps: $("stat-fps"),
  period: $("stat-period"),
  latency: $("stat-latency"),
  frames: $("stat-frames"),
  chunks: $("stat-chunks"),
  participants: $("stat-participants"),
  controls: $("controls"),
  heldKeys: $("held-keys"),
  keyButtons: Array.from(document.querySelectorAll(".key[data-key]")),
  startForm: $("start-form"),
  startButton: $("btn-start"),
  image: $("image"),
  prompt: $("prompt"),
  identity: $("identity"),
  apiKey: $("api-key"),
  config: $("config"),
  sessionCard: $("session-card"),
  sessionId: $("session-id"),
  sessionRoom: $("session-room"),
  queueLine: $("queue-line"),
  share: $("share"),
  shareButton: $("btn-share"),
  shareResult: $("share-result"),
  shareLink: $("share-link"),
  copyButton: $("btn-copy"),
  audioButton: $("btn-audio"),
  deleteButton: $("btn-delete"),
  notice: $("notice"),
  log: $("log"),
  promptForm: $("prompt-form"),
  livePrompt: $("live-prompt"),
};

// -- state ------------------------------------------------------------------------------------

const state = {
  mode: "controller", // or "viewer"
  session: null, // {session_id, room, token, transport, websocket_path, livekit_url}
  link: null, // the active connection (LocalLink or LiveKitLink)
  pollTimer: null,
  refreshTimer: null,
  heartbeatTimer: null,
  heldCodes: new Map(), // source (KeyboardEvent.code or "btn:<key>") -> normalized key
  sentKeys: "", // the last control_state sent, as a sorted string
  frameTimes: [], // arrival times (ms) of recent frames, for the client-side fps
  chunkTimes: [], // arrival times (ms) of recent chunk messages, for the fallback chunk period
  frameCount: 0,
  chunkCount: 0,
  frameUrl: null,
  lastControlChangeAt: null, // performance.now() of the last control_state change
  serverMetrics: null, // the latest tf.metrics data
  chunkLatency: null, // control_to_output_seconds from the latest chunk that carried one
  clientLatency: null, // fallback: key change -> next chunk, seconds
  participants: new Set(),
  audio: null, // AudioPlayer
  ended: null, // {kind, text} once the stream finished, failed or the room connection closed
  leaseWaiting: false, // the notice says "Waiting for the model": the next frame replaces it
};

// -- small helpers ----------------------------------------------------------------------------

function randomSuffix(length = 4) {
  const bytes = new Uint8Array(length);
  crypto.getRandomValues(bytes);
  return Array.from(bytes, (b) => "abcdefghijklmnopqrstuvwxyz0123456789"[b % 36]).join("");
}

function setNotice(text, kind = "info") {
  ui.notice.textContent = text;
  ui.notice.dataset.kind = kind;
}

function log(text, kind = "info") {
  const item = document.createElement("li");
  item.dataset.kind = kind;
  const time = document.createElement("time");
  time.textContent = new Date().toLocaleTimeString();
  item.append(time, " ", text);
  ui.log.prepend(item);
  while (ui.log.children.length > LOG_LIMIT) ui.log.lastElementChild.remove();
}

function formatSeconds(value) {
  if (typeof value !== "number" || !Number.isFinite(value)) return null;
  return value < 1 ? `${Math.round(value * 1000)} ms` : `${value.toFixed(2)} s`;
}

function apiHeaders(json = false) {
  const headers = {};
  if (json) headers["Content-Type"] = "application/json";
  const key = ui.apiKey.value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

async function api(method, path, body) {
  const response = await fetch(path, {
    method,
    headers: apiHeaders(body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  let data = null;
  try {
    data = await response.json();
  } catch {
    data = null;
  }
  if (!response.ok) {
    const detail = data && (data.detail || data.error) ? `${data.error}: ${data.detail}` : response.statusText;
    const error = new Error(`${method} ${path} → ${response.status} ${detail}`);
    error.status = response.status;
    error.data = data;
    throw error;
  }
  return { status: response.status, data };
}

function readFileBase64(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => {
      const text = String(reader.result);
      resolve(text.slice(text.indexOf(",") + 1));
    };
    reader.onerror = () => reject(reader.error || new Error("could not read the file"));
    reader.readAsDataURL(file);
  });
}

function wsUrl(path, token) {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const sep = path.includes("?") ? "&" : "?";
  return `${scheme}://${location.host}${path}${sep}token=${encodeURIComponent(token)}`;
}

function loadScript(src) {
  return new Promise((resolve, reject) => {
    const script = document.createElement("script");
    script.src = src;
    script.async = true;
    const timer = setTimeout(() => reject(new Error(`timed out loading ${src}`)), 20000);
    script.onload = () => {
      clearTimeout(timer);
      resolve();
    };
    script.onerror = () => {
      clearTimeout(timer);
      script.remove();
      reject(new Error(`could not load ${src}`));
    };
    document.head.append(script);
  });
}

// -- audio (local transport): PCM16 chunks scheduled back to back with WebAudio ------------------

class AudioPlayer {
  constructor() {
    const Context = window.AudioContext || window.webkitAudioContext;
    this.context = Context ? new Context() : null;
    this.nextTime = 0;
    this.enabled = Boolean(this.context);
  }

  resume() {
    if (this.context && this.context.state === "suspended") this.context.resume().catch(() => {});
  }

  // `buffer` is the whole binary message: "A" + u32le rate + u16le channels + PCM16 (little-endian).
  play(buffer) {
    if (!this.enabled || !this.context || buffer.byteLength < 7) return;
    const view = new DataView(buffer);
    const rate = view.getUint32(1, true);
    const channels = view.getUint16(5, true);
    if (!rate || !channels) return;
    const frames = Math.floor((buffer.byteLength - 7) / (2 * channels));
    if (frames <= 0) return;
    let audioBuffer;
    try {
      audioBuffer = this.context.createBuffer(channels, frames, rate);
    } catch {
      return; // a rate WebAudio does not support: skip audio, keep the video
    }
    for (let c = 0; c < channels; c += 1) {
      const out = audioBuffer.getChannelData(c);
      for (let i = 0; i < frames; i += 1) {
        out[i] = view.getInt16(7 + 2 * (i * channels + c), true) / 32768;
      }
    }
    const source = this.context.createBufferSource();
    source.buffer = audioBuffer;
    source.connect(this.context.destination);
    const now = this.context.currentTime;
    if (this.nextTime < now + 0.02 || this.nextTime > now + 2) this.nextTime = now + 0.05; // resync on gaps or drift
    source.start(this.nextTime);
    this.nextTime += audioBuffer.duration;
  }

  close() {
    if (this.context) this.context.close().catch(() => {});
    this.context = null;
    this.enabled = false;
  }
}

function ensureAudio() {
  if (!state.audio) {
    try {
      state.audio = new AudioPlayer();
    } catch {
      state.audio = null;
    }
  }
  if (state.audio) state.audio.resume();
  return state.audio;
}

function updateAudioButton() {
  const on = Boolean(state.audio && state.audio.enabled) || Boolean(state.link && state.link.audioOn);
  ui.audioButton.setAttribute("aria-pressed", String(on));
  ui.audioButton.textContent = on ? "Mute audio" : "Enable audio";
}

// -- media ----------------------------------------------------------------------------------------

function showFrame(jpegBytes) {
  const url = URL.createObjectURL(new Blob([jpegBytes], { type: "image/jpeg" }));
  const previous = state.frameUrl;
  state.frameUrl = url;
  ui.frame.src = url;
  if (previous) URL.revokeObjectURL(previous);
  if (ui.frame.hidden) {
    ui.frame.hidden = false;
    ui.placeholder.hidden = true;
  }
  countFrame();
}

function countFrame() {
  const now = performance.now();
  state.frameCount += 1;
  if ((state.frameCount === 1 || state.leaseWaiting) && !state.ended) {
    state.leaseWaiting = false;
    setNotice(state.mode === "viewer" ? "Streaming (viewing)." : "Streaming: hold W A S D / I J K L to steer.");
    if (state.frameCount === 1) log("first frame");
  }
  state.frameTimes.push(now);
  while (state.frameTimes.length && now - state.frameTimes[0] > 2000) state.frameTimes.shift();
  ui.frames.textContent = String(state.frameCount);
}

function clearVideo(message) {
  if (state.frameUrl) URL.revokeObjectURL(state.frameUrl);
  state.frameUrl = null;
  ui.frame.removeAttribute("src");
  ui.frame.hidden = true;
  ui.lkVideo.hidden = true;
  ui.placeholder.hidden = false;
  if (message) ui.placeholderText.textContent = message;
}

// -- stats ----------------------------------------------------------------------------------------

function renderStats() {
  const now = performance.now();
  while (state.frameTimes.length && now - state.frameTimes[0] > 2000) state.frameTimes.shift();
  const times = state.frameTimes;
  let clientFps = null;
  if (times.length > 1) clientFps = (times.length - 1) / ((times[times.length - 1] - times[0]) / 1000);
  if (times.length && now - times[times.length - 1] > 1500) clientFps = 0;

  const metrics = state.serverMetrics || {};
  const serverFps = typeof metrics.published_fps === "number" ? metrics.published_fps : null;
  const parts = [];
  if (clientFps !== null) parts.push(clientFps.toFixed(1));
  if (serverFps !== null) parts.push(`(${serverFps.toFixed(1)})`);
  ui.fps.textContent = parts.length ? parts.join(" ") : "—";

  let period = typeof metrics.chunk_period_seconds === "number" ? metrics.chunk_period_seconds : null;
  let periodSource = "";
  if (period === null && state.chunkTimes.length > 1) {
    const c = state.chunkTimes;
    period = (c[c.length - 1] - c[0]) / 1000 / (c.length - 1);
    periodSource = " (measured)";
  }
  ui.period.textContent = formatSeconds(period) ? formatSeconds(period) + periodSource : "—";

  const serverLatency = typeof metrics.control_to_output_seconds === "number"
    ? metrics.control_to_output_seconds
    : state.chunkLatency;
  if (formatSeconds(serverLatency)) {
    ui.latency.textContent = formatSeconds(serverLatency);
  } else if (formatSeconds(state.clientLatency)) {
    ui.latency.textContent = `${formatSeconds(state.clientLatency)} (measured)`;
  } else {
    ui.latency.textContent = "—";
  }
  ui.chunks.textContent = String(state.chunkCount);
}

function isServerIdentity(identity) {
  return typeof identity === "string" && identity.startsWith(SERVER_IDENTITY_PREFIX);
}

function renderParticipants() {
  const all = Array.from(state.participants).filter((identity) => typeof identity === "string" && identity);
  const people = all.filter((identity) => !isServerIdentity(identity)).sort();
  const servers = all.filter(isServerIdentity).sort();
  if (!people.length && !servers.length) ui.participants.textContent = "—";
  else ui.participants.textContent = `${people.length}${servers.length ? " + server" : ""}`;
  // The title lists people first, then the server's publisher(s).
  ui.participants.title = [...people, ...servers].join(", ");
}

setInterval(renderStats, 500);

// -- incoming data (both transports) -----------------------------------------------------------------

function handleData(topic, payload, from) {
  if (typeof payload === "string") {
    try {
      payload = JSON.parse(payload);
    } catch {
      log(`${topic}: ${payload}`);
      return;
    }
  }
  if (!payload || typeof payload !== "object") return;
  if ((topic === METRICS_TOPIC || topic === STATUS_TOPIC) && !isServerIdentity(from)) {
    return; // status and metrics come from the server's worker only: anyone else may be posing as it
  }
  if (topic === METRICS_TOPIC) {
    if (payload.type === "metrics" && payload.data && typeof payload.data === "object") {
      state.serverMetrics = payload.data;
      renderStats();
    }
    return;
  }
  if (topic === STATUS_TOPIC) {
    handleStatus(payload);
    return;
  }
  if (topic === CONTROL_TOPIC && from) {
    return; // another participant's controls, echoed to the room: nothing to show
  }
  log(`${topic}: ${JSON.stringify(payload).slice(0, 200)}`);
}

function handleStatus(message) {
  const data = message.data && typeof message.data === "object" ? message.data : {};
  switch (message.type) {
    case "status":
      ui.stage.textContent = message.stage || "—";
      if (SESSION_STATES.has(message.stage)) setSessionStatus(message.stage);
      if (!(message.stage === "running" && state.frameCount > 0)) setNotice(`Stage: ${message.stage}`);
      log(`stage ${message.stage}${data.worker_id ? ` on ${data.worker_id}` : ""}`);
      break;
    case "chunk": {
      state.chunkCount += 1;
      const now = performance.now();
      state.chunkTimes.push(now);
      if (state.chunkTimes.length > 8) state.chunkTimes.shift();
      if (typeof data.control_to_output_seconds === "number") state.chunkLatency = data.control_to_output_seconds;
      if (state.lastControlChangeAt !== null) {
        state.clientLatency = (now - state.lastControlChangeAt) / 1000;
        state.lastControlChangeAt = null;
      }
      if (ui.stage.textContent === "—") ui.stage.textContent = "streaming";
      renderStats();
      break;
    }
    case "lease_queued":
    case "lease_granted":
    case "lease_parked":
      showLease(message.type, message.queue_position);
      break;
    case "lease": // an older server's shape: {"type": "lease", "event": "lease_granted", ...}
      showLease(String(message.event || ""), message.queue_position);
      break;
    case "control_rejected":
      setNotice(`Control rejected: ${message.reason}${message.detail ? ` — ${message.detail}` : ""}`, "warn");
      log(`control rejected: ${message.reason}${message.detail ? ` (${message.detail})` : ""}`, "warn");
      break;
    case "done": {
      ui.stage.textContent = "done";
      const text = `Stream finished: ${message.total_chunks} chunks, ${message.published_frames} frames.`;
      setNotice(text);
      log(`done: ${message.total_chunks} chunks, ${message.published_frames} frames`);
      endStream("done", text);
      break;
    }
    case "error": {
      ui.stage.textContent = "error";
      const text = `Error: ${message.reason}${message.detail ? ` — ${message.detail}` : ""}`;
      setNotice(text, "error");
      log(`error: ${message.reason} ${message.detail || ""}`, "error");
      endStream("error", text);
      break;
    }
    default:
      log(`status: ${JSON.stringify(message).slice(0, 200)}`);
  }
}

// The execution lease (pipelines/lease.py): the model is shared, a session waits its turn for it.
function showLease(event, position) {
  const where = typeof position === "number" ? ` (position ${position})` : "";
  let text;
  let kind = "info";
  switch (event) {
    case "lease_granted":
      text = "Lease granted";
      break;
    case "lease_queued":
      text = `Waiting for the model${where}`;
      kind = "warn";
      break;
    case "lease_parked":
      text = "Parked (idle)";
      break;
    default:
      text = `Lease ${event.replace(/^lease_/, "") || "changed"}${where}`;
  }
  if (!state.ended) {
    setNotice(`${text}.`, kind);
    state.leaseWaiting = event === "lease_queued";
  }
  log(text.toLowerCase());
}

// The stream is over (done, error, or the room connection closed): everything that steers it goes
// dead, the heartbeat stops, the room connection is closed, and the screen says how it ended.
function endStream(kind, text) {
  if (state.ended) return;
  state.ended = { kind, text };
  stopHeartbeat();
  state.heldCodes.clear();
  state.sentKeys = "";
  for (const button of ui.keyButtons) button.setAttribute("aria-pressed", "false");
  ui.heldKeys.textContent = "Held keys: none";
  setControlsEnabled(false);
  ui.controls.dataset.ended = kind;
  ui.screen.dataset.ended = kind;
  ui.endBanner.textContent = kind === "done" ? text : text.replace(/\.$/, "") + ".";
  ui.endBanner.dataset.kind = kind === "done" ? "info" : kind === "error" ? "error" : "warn";
  ui.endBanner.hidden = false;
  ui.shareButton.disabled = true;
  ui.queueLine.hidden = true;
  disconnect();
  state.participants = new Set(); // this page has left the room
  renderParticipants();
  // The final session state (closed, failed, …) without waiting for the next tick; the runner settles
  // it just after its last message, so look again shortly too.
  refreshSession();
  setTimeout(refreshSession, 750);
}

function clearEnded() {
  state.ended = null;
  state.leaseWaiting = false;
  delete ui.controls.dataset.ended;
  delete ui.screen.dataset.ended;
  ui.endBanner.hidden = true;
  ui.endBanner.textContent = "";
  ui.shareButton.disabled = false;
}

// -- local transport ---------------------------------------------------------------------------------

class LocalLink {
  constructor(path, token) {
    this.url = wsUrl(path, token);
    this.socket = null;
    this.closedByUs = false;
    this.audioOn = false;
  }

  connect() {
    const socket = new WebSocket(this.url);
    socket.binaryType = "arraybuffer";
    this.socket = socket;
    socket.addEventListener("open", () => {
      setNotice("Connected; waiting for the stream…");
      log("connected to the room");
    });
    socket.addEventListener("message", (event) => this.onMessage(event.data));
    socket.addEventListener("close", (event) => {
      if (this.socket !== socket) return;
      this.socket = null;
      const why = event.reason ? `: ${event.reason}` : "";
      log(`connection closed (${event.code}${why})`, this.closedByUs ? "info" : "warn");
      if (!this.closedByUs) setNotice(`Disconnected (${event.code}${why}).`, event.code === 1000 ? "info" : "warn");
      onDisconnected(this);
    });
    socket.addEventListener("error", () => {
      if (!this.closedByUs) log("connection error", "warn");
    });
  }

  onMessage(data) {
    if (data instanceof ArrayBuffer) {
      if (data.byteLength < 1) return;
      const kind = new Uint8Array(data, 0, 1)[0];
      if (kind === 0x56) showFrame(new Uint8Array(data, 1)); // "V"
      else if (kind === 0x41 && state.audio && state.audio.enabled) state.audio.play(data); // "A"
      return;
    }
    let message;
    try {
      message = JSON.parse(data);
    } catch {
      return;
    }
    switch (message.type) {
      case "data":
        handleData(message.topic, message.payload, message.from);
        break;
      case "joined":
        state.participants = new Set([message.identity, ...(message.participants || [])]);
        renderParticipants();
        log(`joined as ${message.identity} (${message.role})`);
        break;
      case "participant_joined":
        state.participants.add(message.identity);
        renderParticipants();
        log(`${message.identity} joined`);
        break;
      case "participant_left":
        state.participants.delete(message.identity);
        renderParticipants();
        log(`${message.identity} left`);
        break;
      case "refused": {
        // every refusal names what was wrong in its detail (its reason is the code for programs)
        const why = message.detail ? `${message.reason}: ${message.detail}` : message.reason;
        setNotice(`Refused: ${why}`, "warn");
        log(`refused: ${why}`, "warn");
        break;
      }
      default:
        break;
    }
  }

  get open() {
    return Boolean(this.socket && this.socket.readyState === WebSocket.OPEN);
  }

  send(topic, payload) {
    if (!this.open) return false;
    this.socket.send(JSON.stringify({ topic, payload }));
    return true;
  }

  close() {
    this.closedByUs = true;
    if (this.socket) this.socket.close(1000, "bye");
  }
}

// -- LiveKit transport ----------------------------------------------------------------------------------

class LiveKitLink {
  constructor(url, token) {
    this.url = url;
    this.token = token;
    this.room = null;
    this.closedByUs = false;
    this.audioOn = false;
    this.statsTimer = null;
    this.encoder = new TextEncoder();
    this.decoder = new TextDecoder();
  }

  async connect() {
    const LK = window.LivekitClient;
    const room = new LK.Room({ adaptiveStream: true, dynacast: false });
    this.room = room;
    const E = LK.RoomEvent;
    room.on(E.TrackSubscribed, (track) => {
      if (track.kind === "video") {
        track.attach(ui.lkVideo);
        ui.lkVideo.hidden = false;
        ui.frame.hidden = true;
        ui.placeholder.hidden = true;
        // Frames are counted as the decoder reports them (WebRTC stats), not per painted frame: a paused
        // or hidden element (adaptive stream) paints nothing while frames still arrive.
        clearInterval(this.statsTimer);
        this.statsTimer = setInterval(() => this.readDecodedFrames(track), STATS_PERIOD_MS);
      } else if (track.kind === "audio") {
        track.attach(ui.lkAudio);
      }
    });
    room.on(E.TrackUnsubscribed, (track) => track.detach());
    room.on(E.DataReceived, (payload, participant, _kind, topic) => {
      let text;
      try {
        text = this.decoder.decode(payload);
      } catch {
        return;
      }
      // LiveKit names no participant only for data its server API sent (a session that ended queued:
      // the stream server's last word), and only a holder of the API secret can send that
      handleData(topic || "", text, participant ? participant.identity : SERVER_STATUS_IDENTITY);
    });
    room.on(E.ParticipantConnected, (participant) => {
      state.participants.add(participant.identity);
      renderParticipants();
      log(`${participant.identity} joined`);
    });
    room.on(E.ParticipantDisconnected, (participant) => {
      state.participants.delete(participant.identity);
      renderParticipants();
      log(`${participant.identity} left`);
    });
    room.on(E.AudioPlaybackStatusChanged, () => {
      this.audioOn = room.canPlaybackAudio;
      updateAudioButton();
    });
    room.on(E.Disconnected, (reason) => {
      if (this.room !== room) return;
      clearInterval(this.statsTimer);
      this.room = null;
      log(`disconnected from LiveKit${reason !== undefined ? ` (${reason})` : ""}`, this.closedByUs ? "info" : "warn");
      if (!this.closedByUs) setNotice("Disconnected from the LiveKit room.", "warn");
      onDisconnected(this);
    });
    await room.connect(this.url, this.token);
    state.participants = new Set([room.localParticipant.identity, ...Array.from(room.remoteParticipants.values(), (p) => p.identity)]);
    renderParticipants();
    setNotice("Connected to LiveKit; waiting for the stream…");
    log(`joined LiveKit room ${room.name} as ${room.localParticipant.identity}`);
  }

  async readDecodedFrames(track) {
    if (!this.room || typeof track.getRTCStatsReport !== "function") return;
    const report = await track.getRTCStatsReport().catch(() => undefined);
    if (!report) return;
    report.forEach((entry) => {
      if (entry.type === "inbound-rtp" && entry.kind === "video") {
        while (state.frameCount < entry.framesDecoded) countFrame();
      }
    });
  }

  get open() {
    return Boolean(this.room);
  }

  send(topic, payload) {
    if (!this.room) return false;
    const bytes = this.encoder.encode(JSON.stringify(payload));
    this.room.localParticipant.publishData(bytes, { reliable: true, topic }).catch((error) => {
      log(`could not send on ${topic}: ${error.message || error}`, "warn");
    });
    return true;
  }

  async toggleAudio() {
    if (!this.room) return;
    if (this.audioOn) {
      ui.lkAudio.muted = true;
      this.audioOn = false;
    } else {
      ui.lkAudio.muted = false;
      await this.room.startAudio().catch(() => {});
      this.audioOn = true;
    }
    updateAudioButton();
  }

  close() {
    this.closedByUs = true;
    clearInterval(this.statsTimer);
    if (this.room) this.room.disconnect();
  }
}

async function ensureLiveKit() {
  if (window.LivekitClient) return true;
  try {
    await loadScript(LIVEKIT_BUNDLE);
  } catch {
    return false;
  }
  return Boolean(window.LivekitClient);
}

// -- connecting ---------------------------------------------------------------------------------------

async function connect() {
  const session = state.session;
  if (!session || state.link) return;
  clearVideo("Waiting for the first frame…");
  if (session.transport === "livekit") {
    if (!(await ensureLiveKit())) {
      const text = "This server uses LiveKit. LiveKit mode needs the bundled livekit-client SDK "
        + `(${LIVEKIT_BUNDLE}), which is missing: run server/static/build_vendor.sh when packaging the server.`;
      setNotice(text, "error");
      log(text, "error");
      clearVideo("LiveKit mode needs the bundled livekit-client (see the status panel).");
      return;
    }
    if (!session.livekit_url) {
      setNotice("The server did not say which LiveKit URL to join.", "error");
      return;
    }
    const link = new LiveKitLink(session.livekit_url, session.token);
    state.link = link;
    try {
      await link.connect();
    } catch (error) {
      state.link = null;
      setNotice(`Could not join the LiveKit room: ${error.message || error}`, "error");
      log(`LiveKit connect failed: ${error.message || error}`, "error");
      return;
    }
  } else {
    if (!session.websocket_path) {
      setNotice("The server gave no WebSocket path for this session.", "error");
      return;
    }
    const link = new LocalLink(session.websocket_path, session.token);
    state.link = link;
    link.connect();
  }
  if (state.mode === "controller" && !state.ended) {
    ui.controls.hidden = false;
    setControlsEnabled(true);
  }
}

function onDisconnected(link) {
  if (state.link !== link) return; // an older connection, already replaced
  state.link = null;
  releaseAll();
  stopHeartbeat();
  setControlsEnabled(false);
  if (!state.ended) {
    endStream(link.closedByUs ? "left" : "disconnected", link.closedByUs ? "Left the room." : "Disconnected from the room.");
  }
  if (state.audio) {
    state.audio.close();
    state.audio = null;
  }
  updateAudioButton();
  ui.startButton.disabled = false;
  if (ui.frame.hidden && ui.lkVideo.hidden) clearVideo("The stream ended.");
}

function disconnect() {
  if (state.link) state.link.close();
}

function setControlsEnabled(enabled) {
  for (const element of ui.controls.querySelectorAll("button, input")) element.disabled = !enabled;
}

// -- keys ------------------------------------------------------------------------------------------------

function heldKeys() {
  const keys = new Set(state.heldCodes.values());
  return KEY_ORDER.filter((key) => keys.has(key));
}

function sendControl(payload) {
  if (state.mode !== "controller" || !state.link || state.ended) return false;
  return state.link.send(CONTROL_TOPIC, payload);
}

function syncKeys(force = false) {
  const keys = heldKeys();
  const signature = keys.join("");
  for (const button of ui.keyButtons) {
    button.setAttribute("aria-pressed", String(keys.includes(button.dataset.key)));
  }
  ui.heldKeys.textContent = `Held keys: ${keys.length ? keys.map((k) => k.toUpperCase()).join(" ") : "none"}`;
  if (signature !== state.sentKeys || force) {
    if (signature !== state.sentKeys) state.lastControlChangeAt = performance.now();
    state.sentKeys = signature;
    sendControl({ type: "control_state", controls: keys });
  }
  if (keys.length && !state.heartbeatTimer) {
    state.heartbeatTimer = setInterval(() => {
      if (heldKeys().length) sendControl({ type: "control_state", controls: heldKeys() });
      else stopHeartbeat();
    }, HEARTBEAT_MS);
  } else if (!keys.length) {
    stopHeartbeat();
  }
}

function stopHeartbeat() {
  if (state.heartbeatTimer) clearInterval(state.heartbeatTimer);
  state.heartbeatTimer = null;
}

function releaseAll() {
  if (!state.heldCodes.size) return;
  state.heldCodes.clear();
  syncKeys(); // sends the empty control_state when still connected
}

function typingTarget(target) {
  if (!(target instanceof HTMLElement)) return false;
  if (target.isContentEditable) return true;
  const tag = target.tagName;
  return tag === "TEXTAREA" || tag === "SELECT" || (tag === "INPUT" && target.type !== "file");
}

function controlsActive() {
  return state.mode === "controller" && !state.ended && Boolean(state.link) && state.link.open;
}

window.addEventListener("keydown", (event) => {
  const key = KEY_CODES[event.code];
  if (!key || !controlsActive() || typingTarget(event.target)) return;
  if (event.ctrlKey || event.metaKey || event.altKey) return;
  event.preventDefault(); // no page scrolling on arrows
  if (event.repeat && state.heldCodes.has(event.code)) return;
  state.heldCodes.set(event.code, key);
  syncKeys();
});

window.addEventListener("keyup", (event) => {
  if (!state.heldCodes.has(event.code)) return;
  state.heldCodes.delete(event.code);
  syncKeys();
});

window.addEventListener("blur", () => releaseAll());
document.addEventListener("visibilitychange", () => {
  if (document.hidden) releaseAll();
});

// On-screen keys: hold with a pointer (mouse, touch, pen), or toggle with Enter/Space when focused.
for (const button of ui.keyButtons) {
  const source = `btn:${button.dataset.key}`;
  button.addEventListener("pointerdown", (event) => {
    if (!controlsActive()) return;
    event.preventDefault();
    if (button.setPointerCapture) {
      try {
        button.setPointerCapture(event.pointerId);
      } catch {
        // not capturable: fine
      }
    }
    state.heldCodes.set(source, button.dataset.key);
    syncKeys();
  });
  const release = () => {
    if (state.heldCodes.delete(source)) syncKeys();
  };
  button.addEventListener("pointerup", release);
  button.addEventListener("pointercancel", release);
  button.addEventListener("lostpointercapture", release);
  button.addEventListener("click", (event) => {
    if (event.detail !== 0 || !controlsActive()) return; // keyboard activation only (pointer handled above)
    if (state.heldCodes.has(source)) state.heldCodes.delete(source);
    else state.heldCodes.set(source, button.dataset.key);
    syncKeys();
  });
  button.addEventListener("blur", release);
}

// -- session lifecycle (controller) ---------------------------------------------------------------------

function showSession(session) {
  ui.sessionCard.hidden = false;
  ui.sessionId.textContent = session.session_id;
  ui.sessionRoom.textContent = session.room || "—";
  ui.shareResult.hidden = true;
  ui.share.hidden = state.mode !== "controller";
  ui.deleteButton.hidden = state.mode !== "controller";
}

function showQueue(position) {
  ui.queueLine.hidden = false;
  ui.queueLine.textContent = typeof position === "number" ? `Queued, position ${position}` : "Queued…";
  setNotice(ui.queueLine.textContent);
}

function stopPolling() {
  if (state.pollTimer) clearTimeout(state.pollTimer);
  state.pollTimer = null;
}

async function pollQueue() {
  stopPolling();
  const session = state.session;
  if (!session) return;
  try {
    const { data } = await api("GET", `/v1/stream/sessions/${encodeURIComponent(session.session_id)}`);
    if (state.session !== session) return;
    ui.status.textContent = data.status;
    if (WAITING.has(data.status)) {
      showQueue(data.queue_position);
      state.pollTimer = setTimeout(pollQueue, POLL_MS);
      return;
    }
    ui.queueLine.hidden = true;
    if (TERMINAL.has(data.status)) {
      setNotice(`The session ended while queued (${data.status}${data.error ? `: ${data.error}` : ""}).`, "warn");
      log(`session ${data.status} while queued`, "warn");
      ui.startButton.disabled = false;
      return;
    }
    log(`left the queue (${data.status})`);
    await connect();
  } catch (error) {
    if (state.session !== session) return;
    if (error.status === 404) {
      setNotice("The session no longer exists.", "warn");
      ui.startButton.disabled = false;
      return;
    }
    log(`poll failed: ${error.message}`, "warn");
    state.pollTimer = setTimeout(pollQueue, POLL_MS);
  }
}

function setSessionStatus(status) {
  if (!status) return;
  // A terminal state is final: a late answer or message never takes it back.
  if (TERMINAL.has(ui.status.textContent) && !TERMINAL.has(status)) return;
  ui.status.textContent = status;
}

async function refreshSession() {
  const session = state.session;
  if (!session || state.pollTimer) return;
  try {
    const { data } = await api("GET", `/v1/stream/sessions/${encodeURIComponent(session.session_id)}`);
    if (state.session !== session) return;
    setSessionStatus(data.status);
    if (TERMINAL.has(data.status)) stopRefresh();
  } catch (error) {
    if (state.session === session && (error.status === 404 || error.status === 401)) stopRefresh();
  }
}

// The session's state now, then every few seconds until it ends.
function startRefresh() {
  stopRefresh();
  state.refreshTimer = setInterval(refreshSession, SESSION_REFRESH_MS);
  refreshSession();
}

function stopRefresh() {
  if (state.refreshTimer) clearInterval(state.refreshTimer);
  state.refreshTimer = null;
}

function resetStats() {
  state.frameTimes = [];
  state.chunkTimes = [];
  state.frameCount = 0;
  state.chunkCount = 0;
  state.serverMetrics = null;
  state.chunkLatency = null;
  state.clientLatency = null;
  state.lastControlChangeAt = null;
  state.participants = new Set();
  clearEnded();
  ui.stage.textContent = "—";
  ui.status.textContent = "—";
  ui.frames.textContent = "0";
  renderParticipants();
  renderStats();
}

async function startSession(event) {
  event.preventDefault();
  const identity = ui.identity.value.trim();
  if (!identity) {
    setNotice("Choose an identity.", "warn");
    ui.identity.focus();
    return;
  }
  const body = { identity };
  const prompt = ui.prompt.value.trim();
  if (prompt) body.prompt = prompt;
  const configText = ui.config.value.trim();
  if (configText) {
    try {
      body.config = JSON.parse(configText);
    } catch {
      setNotice("Config must be a JSON object.", "warn");
      ui.config.focus();
      return;
    }
    if (!body.config || typeof body.config !== "object" || Array.isArray(body.config)) {
      setNotice("Config must be a JSON object.", "warn");
      ui.config.focus();
      return;
    }
  }
  ui.startButton.disabled = true;
  const file = ui.image.files && ui.image.files[0];
  try {
    if (file) {
      setNotice(`Reading ${file.name}…`);
      body.image_b64 = await readFileBase64(file);
    }
  } catch (error) {
    setNotice(`Could not read the image: ${error.message || error}`, "error");
    ui.startButton.disabled = false;
    return;
  }

  // One session at a time: leave the previous room first.
  stopPolling();
  stopRefresh();
  disconnect();
  state.link = null; // the old link's close event is ignored (onDisconnected checks the link)
  resetStats();
  ensureAudio(); // created inside the click gesture so the browser lets it play later
  if (state.audio) state.audio.enabled = false; // muted until the user enables it
  updateAudioButton();

  setNotice("Creating the session…");
  let created;
  try {
    created = await api("POST", "/v1/stream/sessions", body);
  } catch (error) {
    const retry = error.status === 429 ? " The server is full; try again in a few seconds." : "";
    setNotice(`Could not start: ${error.message}.${retry}`, "error");
    log(`start failed: ${error.message}`, "error");
    ui.startButton.disabled = false;
    return;
  }
  const data = created.data;
  state.session = {
    session_id: data.session_id,
    room: data.room,
    token: data.token,
    transport: data.transport,
    websocket_path: data.websocket_path,
    livekit_url: data.livekit_url,
  };
  showSession(state.session);
  ui.status.textContent = data.status;
  log(`session ${data.session_id} created (${data.status}, ${data.transport})`);
  const url = new URL(location.href);
  url.search = "";
  history.replaceState(null, "", url);
  if (data.transport === "livekit" && !(await ensureLiveKit())) {
    await connect(); // reports that the bundle is missing
    ui.startButton.disabled = false;
    return;
  }
  startRefresh();
  if (created.status === 202 || WAITING.has(data.status)) {
    showQueue(data.queue_position);
    state.pollTimer = setTimeout(pollQueue, POLL_MS);
  } else {
    ui.queueLine.hidden = true;
    await connect();
  }
  ui.startButton.disabled = false;
}

async function deleteSession() {
  const session = state.session;
  if (!session) return;
  stopPolling();
  try {
    const { data } = await api("DELETE", `/v1/stream/sessions/${encodeURIComponent(session.session_id)}`);
    ui.status.textContent = data.status;
    setNotice(`Session deleted (${data.status}).`);
    log(`session deleted (${data.status})`);
  } catch (error) {
    setNotice(`Delete failed: ${error.message}`, "error");
    log(`delete failed: ${error.message}`, "error");
    return;
  }
  ui.queueLine.hidden = true;
  disconnect();
}

async function shareAsViewer() {
  const session = state.session;
  if (!session) return;
  ui.shareButton.disabled = true;
  try {
    const identity = `viewer-${randomSuffix()}`;
    const { data } = await api("POST", `/v1/stream/sessions/${encodeURIComponent(session.session_id)}/tokens`, { identity });
    const params = new URLSearchParams({ session: session.session_id, room: data.room || session.room, token: data.token });
    if (session.websocket_path) params.set("ws", session.websocket_path);
    if (session.transport === "livekit" && (data.livekit_url || session.livekit_url)) {
      params.set("lk", data.livekit_url || session.livekit_url);
    }
    ui.shareLink.value = `${location.origin}/?${params}`;
    ui.shareResult.hidden = false;
    ui.shareLink.focus();
    ui.shareLink.select();
    log(`viewer token minted for ${identity}`);
  } catch (error) {
    setNotice(`Could not create a viewer link: ${error.message}`, "error");
  } finally {
    ui.shareButton.disabled = false;
  }
}

async function copyShareLink() {
  const text = ui.shareLink.value;
  if (!text) return;
  try {
    await navigator.clipboard.writeText(text);
    setNotice("Viewer link copied.");
  } catch {
    ui.shareLink.select();
    setNotice("Select the link and copy it (the clipboard is not available here).", "warn");
  }
}

function toggleAudio() {
  if (state.link instanceof LiveKitLink) {
    state.link.toggleAudio();
    return;
  }
  const player = ensureAudio();
  if (!player || !player.context) {
    setNotice("Audio is not supported by this browser.", "warn");
    return;
  }
  player.enabled = !player.enabled;
  player.nextTime = 0;
  updateAudioButton();
}

// -- wiring ---------------------------------------------------------------------------------------------

ui.startForm.addEventListener("submit", startSession);
$("btn-reset").addEventListener("click", () => {
  state.heldCodes.clear();
  state.sentKeys = "";
  syncKeys();
  sendControl({ type: "reset" });
  log("sent reset");
});
$("btn-reset-pose").addEventListener("click", () => {
  sendControl({ type: "reset_pose" });
  log("sent reset pose");
});
$("btn-stop").addEventListener("click", () => {
  releaseAll();
  sendControl({ type: "stop" });
  log("sent stop");
});
ui.deleteButton.addEventListener("click", deleteSession);
ui.shareButton.addEventListener("click", shareAsViewer);
ui.copyButton.addEventListener("click", copyShareLink);
ui.audioButton.addEventListener("click", toggleAudio);
ui.promptForm.addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = ui.livePrompt.value.trim();
  if (!prompt) return;
  if (sendControl({ type: "prompt", prompt })) log(`sent prompt “${prompt.slice(0, 60)}”`);
});
window.addEventListener("pagehide", () => {
  disconnect();
  if (state.frameUrl) URL.revokeObjectURL(state.frameUrl);
});

function init() {
  ui.identity.value = `controller-${randomSuffix()}`;
  setControlsEnabled(false);
  const params = new URLSearchParams(location.search);
  const token = params.get("token");
  const sessionId = params.get("session");
  if (!token || !sessionId) return;

  // Viewer mode: no form, no controls; the same video and status.
  state.mode = "viewer";
  document.body.dataset.mode = "viewer";
  ui.badge.textContent = "Viewer";
  ui.badge.dataset.mode = "viewer";
  ui.startForm.hidden = true;
  ui.controls.hidden = true;
  const lk = params.get("lk");
  state.session = {
    session_id: sessionId,
    room: params.get("room") || "",
    token,
    transport: lk ? "livekit" : "local",
    websocket_path: params.get("ws") || (params.get("room") ? `/v1/rooms/${params.get("room")}/ws` : null),
    livekit_url: lk,
  };
  showSession(state.session);
  ui.placeholderText.textContent = "Joining as a viewer…";
  log(`viewing session ${sessionId}`);
  startRefresh();
  connect();
}

init();
