// shoal playground: POST /v1/tts with format "pcm", played through Web Audio as it streams.
// No dependencies, no build step. State for humans is in the page; state for tests is
// window.shoalPlayground.state (see tests/test_playground.py).
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const LEAD_S = 0.05; // how far ahead of the audio clock the first chunk (or one after a gap) starts
  const PEAK_BIN_S = 0.01; // waveform resolution
  const ENCODED_FORMATS = new Set(['mp3', 'opus', 'flac', 'aac']);

  const ui = {
    form: $('form'), text: $('text'), voice: $('voice'), voiceNote: $('voice-note'),
    latency: $('latency'), format: $('format'), sampleRate: $('sample-rate'),
    refAudio: $('ref-audio'), refText: $('ref-text'), refClear: $('ref-clear'),
    temperature: $('temperature'), temperatureOut: $('temperature-out'),
    topP: $('top-p'), topPOut: $('top-p-out'), seed: $('seed'), maxFrames: $('max-frames'),
    normalize: $('normalize'), apiKey: $('api-key'), generate: $('generate'), stop: $('stop'),
    server: $('server'), status: $('status'), error: $('error'), wave: $('wave'),
    download: $('download'), downloadEncoded: $('download-encoded'),
    stat: {
      ttfa: $('stat-ttfa'), duration: $('stat-duration'), elapsed: $('stat-elapsed'),
      rtf: $('stat-rtf'), chunks: $('stat-chunks'), seed: $('stat-seed'),
    },
  };

  // Everything a test (or a curious user in the console) may want to read.
  const state = {
    status: 'idle', // idle | running | done | stopped | error
    error: null, // {status, message} of the last failure
    runs: 0,
    request: null, // the last body sent (reference audio elided)
    requestStart: null, // performance.now() at Generate
    firstChunkAt: null, // performance.now() when the first audio was scheduled
    doneAt: null, // performance.now() when the stream ended
    ttfaMs: null,
    elapsedMs: null,
    chunks: 0, // AudioBufferSourceNodes scheduled
    samples: 0, // samples decoded and scheduled
    bytes: 0, // body bytes received
    sampleRate: null,
    seed: null,
    requestId: null,
    underruns: 0, // times playback caught up with the stream (a gap in the audio)
    playedAtDoneS: null, // audio-clock seconds of this run already played when the stream ended
    playing: false,
    contextState: null,
  };

  let ctx = null; // AudioContext, created on the first Generate (a user gesture)
  let gain = null;
  let run = null; // the current generation
  let readyInfo = null; // GET /v1/ready's body
  let downloadUrl = null;
  let downloadBlob = null; // the Blob behind the download link

  // ------------------------------------------------------------------ helpers
  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function apiError(resp) {
    const text = await resp.text().catch(() => '');
    let message = text.trim() || resp.statusText || 'request failed';
    try {
      const body = JSON.parse(text);
      if (body && typeof body.message === 'string') message = body.message;
    } catch (_) { /* not JSON: keep the text */ }
    return new ApiError(resp.status, message);
  }

  function authHeaders() {
    const key = ui.apiKey.value.trim();
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  function fmtSeconds(s) {
    if (s == null || !isFinite(s)) return '–';
    return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
  }

  function setStatus(kind, text) {
    state.status = kind;
    ui.status.dataset.state = kind;
    ui.status.textContent = text;
  }

  function showError(err) {
    const status = err instanceof ApiError ? err.status : 0;
    state.error = { status, message: err.message };
    ui.error.textContent = status ? `Error ${status}: ${err.message}` : `Error: ${err.message}`;
    ui.error.hidden = false;
  }

  function clearError() {
    state.error = null;
    ui.error.hidden = true;
    ui.error.textContent = '';
  }

  function readFileBase64(file) {
    return new Promise((resolve, reject) => {
      const r = new FileReader();
      r.onload = () => resolve(String(r.result).split(',', 2)[1] || '');
      r.onerror = () => reject(new Error(`cannot read ${file.name}`));
      r.readAsDataURL(file);
    });
  }

  // 44-byte RIFF header + s16le mono PCM.
  function wavBlob(pieces, rate) {
    const dataBytes = pieces.reduce((n, p) => n + p.byteLength, 0);
    const h = new DataView(new ArrayBuffer(44));
    const ascii = (off, s) => { for (let i = 0; i < s.length; i++) h.setUint8(off + i, s.charCodeAt(i)); };
    ascii(0, 'RIFF'); h.setUint32(4, 36 + dataBytes, true); ascii(8, 'WAVE');
    ascii(12, 'fmt '); h.setUint32(16, 16, true); h.setUint16(20, 1, true); h.setUint16(22, 1, true);
    h.setUint32(24, rate, true); h.setUint32(28, rate * 2, true); h.setUint16(32, 2, true);
    h.setUint16(34, 16, true); ascii(36, 'data'); h.setUint32(40, dataBytes, true);
    return new Blob([h.buffer, ...pieces], { type: 'audio/wav' });
  }

  // ------------------------------------------------------------------ audio
  function ensureContext() {
    if (!ctx) {
      const Ctx = window.AudioContext || window.webkitAudioContext;
      if (!Ctx) throw new Error('this browser has no Web Audio');
      ctx = new Ctx({ latencyHint: 'interactive' });
      gain = ctx.createGain();
      gain.connect(ctx.destination);
      ctx.onstatechange = () => { state.contextState = ctx.state; };
    }
    state.contextState = ctx.state;
    if (ctx.state === 'running') return Promise.resolve();
    // resume() stays pending until a user gesture where autoplay is blocked: don't wait for it
    // (the audio is scheduled anyway and plays once the context runs).
    return Promise.race([ctx.resume(), new Promise((ok) => setTimeout(ok, 1000))]);
  }

  // bytes -> Int16Array of whole samples; an odd trailing byte waits for the next read.
  function takeSamples(r, bytes) {
    let buf = bytes;
    if (r.carry) {
      buf = new Uint8Array(bytes.length + 1);
      buf[0] = r.carry[0];
      buf.set(bytes, 1);
      r.carry = null;
    }
    const n = buf.length >> 1;
    if (buf.length & 1) r.carry = buf.slice(buf.length - 1);
    const view = new DataView(buf.buffer, buf.byteOffset, n * 2);
    const out = new Int16Array(n);
    for (let i = 0; i < n; i++) out[i] = view.getInt16(i * 2, true);
    return out;
  }

  function schedule(r, pcm) {
    const n = pcm.length;
    if (!n) return;
    const buffer = ctx.createBuffer(1, n, r.rate);
    const ch = buffer.getChannelData(0);
    for (let i = 0; i < n; i++) ch[i] = pcm[i] / 32768;
    const src = ctx.createBufferSource();
    src.buffer = buffer;
    src.connect(gain);
    const now = ctx.currentTime;
    if (r.playhead === null) {
      r.playhead = now + LEAD_S;
      r.audioStart = r.playhead;
    } else if (r.playhead < now) { // the stream fell behind playback: restart a little ahead
      state.underruns += 1;
      r.playhead = now + LEAD_S;
    }
    src.start(r.playhead);
    r.playhead += buffer.duration;
    r.sources.add(src);
    src.onended = () => {
      r.sources.delete(src);
      if (r.streamEnded && r.sources.size === 0 && r === run) {
        state.playing = false;
        ui.stop.disabled = true;
      }
    };
    state.playing = true;
    state.chunks += 1;
    state.samples += n;
    r.pieces.push(pcm.buffer);
    addPeaks(r, pcm);
  }

  function stopSources(r) {
    for (const src of r.sources) {
      try { src.stop(); } catch (_) { /* not started yet */ }
    }
    r.sources.clear();
    state.playing = false;
  }

  // ------------------------------------------------------------------ waveform
  function addPeaks(r, pcm) {
    const bin = Math.max(1, Math.round(r.rate * PEAK_BIN_S));
    for (let i = 0; i < pcm.length; i++) {
      const v = Math.abs(pcm[i]);
      if (v > r.peakAcc) r.peakAcc = v;
      if (++r.peakCount === bin) {
        r.peaks.push(r.peakAcc / 32768);
        r.peakAcc = 0;
        r.peakCount = 0;
      }
    }
    drawWave(r);
  }

  function drawWave(r) {
    const c = ui.wave;
    const g = c.getContext('2d');
    const w = c.width;
    const h = c.height;
    const css = getComputedStyle(document.documentElement);
    g.clearRect(0, 0, w, h);
    g.fillStyle = css.getPropertyValue('--wave-bg').trim() || '#eef';
    g.fillRect(0, 0, w, h);
    if (!r || !r.peaks.length) return;
    const span = Math.max(r.peaks.length, Math.round(5 / PEAK_BIN_S)); // at least 5 s wide
    g.fillStyle = css.getPropertyValue('--accent').trim() || '#36c';
    const mid = h / 2;
    for (let x = 0; x < w; x++) {
      const a = Math.floor((x * span) / w);
      const b = Math.min(r.peaks.length, Math.floor(((x + 1) * span) / w));
      if (a >= r.peaks.length) break;
      let p = 0;
      for (let i = a; i < Math.max(b, a + 1); i++) p = Math.max(p, r.peaks[i]);
      const y = Math.max(1, p * mid);
      g.fillRect(x, mid - y, 1, 2 * y);
    }
  }

  // ------------------------------------------------------------------ stats / downloads
  function updateStats() {
    const dur = state.sampleRate ? state.samples / state.sampleRate : null;
    ui.stat.ttfa.textContent = state.ttfaMs == null ? '–' : fmtSeconds(state.ttfaMs / 1000);
    ui.stat.duration.textContent = fmtSeconds(dur);
    ui.stat.elapsed.textContent = state.elapsedMs == null ? '–' : fmtSeconds(state.elapsedMs / 1000);
    ui.stat.rtf.textContent = dur && state.elapsedMs != null ? `${(dur / (state.elapsedMs / 1000)).toFixed(2)}×` : '–';
    ui.stat.chunks.textContent = state.chunks ? String(state.chunks) : '–';
    ui.stat.seed.textContent = state.seed == null ? '–' : state.seed;
  }

  function resetDownloads() {
    if (downloadUrl) URL.revokeObjectURL(downloadUrl);
    downloadUrl = null;
    downloadBlob = null;
    ui.download.hidden = true;
    ui.download.removeAttribute('href');
    ui.downloadEncoded.hidden = true;
  }

  function offerDownloads(r, partial) {
    if (!state.samples) return;
    const fmt = ui.format.value;
    const base = `shoal-${state.seed ?? 'audio'}`;
    const blob = fmt === 'pcm' ? new Blob(r.pieces, { type: 'audio/pcm' }) : wavBlob(r.pieces, r.rate);
    const ext = fmt === 'pcm' ? 'pcm' : 'wav';
    downloadBlob = blob;
    downloadUrl = URL.createObjectURL(blob);
    ui.download.href = downloadUrl;
    ui.download.download = `${base}${partial ? '-partial' : ''}.${ext}`;
    ui.download.textContent = `Download ${ext}${partial ? ' (partial)' : ''} · ${(blob.size / 1024).toFixed(0)} KiB`;
    ui.download.hidden = false;
    if (ENCODED_FORMATS.has(fmt) && state.seed != null && !partial) {
      ui.downloadEncoded.textContent = `Download ${fmt} (re-synthesised, seed ${state.seed})`;
      ui.downloadEncoded.hidden = false;
      ui.downloadEncoded.disabled = false;
    }
  }

  // Compressed formats: the same request (same seed = same audio) again, in that format.
  async function downloadEncoded() {
    if (!run || !run.body || state.seed == null) return;
    const fmt = ui.format.value;
    const body = { ...run.body, format: fmt, seed: Number(state.seed) };
    delete body.streaming;
    const label = ui.downloadEncoded.textContent;
    ui.downloadEncoded.disabled = true;
    ui.downloadEncoded.textContent = `Encoding ${fmt}…`;
    try {
      const resp = await fetch('v1/tts', {
        method: 'POST', cache: 'no-store', body: JSON.stringify(body),
        headers: { 'Content-Type': 'application/json', ...authHeaders() },
      });
      if (!resp.ok) throw await apiError(resp);
      const blob = await resp.blob();
      const url = URL.createObjectURL(blob);
      const a = document.createElement('a');
      a.href = url;
      a.download = `shoal-${state.seed}.${fmt === 'opus' ? 'ogg' : fmt}`;
      document.body.appendChild(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60_000);
    } catch (err) {
      showError(err);
    } finally {
      ui.downloadEncoded.textContent = label;
      ui.downloadEncoded.disabled = false;
    }
  }

  // ------------------------------------------------------------------ generation
  async function buildBody() {
    const body = {
      text: ui.text.value,
      format: 'pcm',
      streaming: true,
      latency: ui.latency.value,
      temperature: Number(ui.temperature.value),
      top_p: Number(ui.topP.value),
      normalize: ui.normalize.checked,
    };
    if (ui.maxFrames.value.trim() !== '') body.max_new_tokens = Number(ui.maxFrames.value);
    if (ui.seed.value.trim() !== '') body.seed = Number(ui.seed.value);
    if (ui.sampleRate.value) body.sample_rate = Number(ui.sampleRate.value);
    const shown = { ...body };
    if (ui.voice.value) {
      body.reference_id = ui.voice.value;
      shown.reference_id = body.reference_id;
    } else if (ui.refAudio.files && ui.refAudio.files.length) {
      const file = ui.refAudio.files[0];
      body.references = [{ audio: await readFileBase64(file), text: ui.refText.value }];
      shown.references = [{ audio: `<${file.name}, ${file.size} bytes>`, text: ui.refText.value }];
    }
    return { body, shown };
  }

  async function generate() {
    if (run && !run.streamEnded) stop();
    if (run) stopSources(run);
    const r = {
      controller: new AbortController(), body: null, rate: null, carry: null, playhead: null,
      audioStart: null, sources: new Set(), pieces: [], peaks: [], peakAcc: 0, peakCount: 0,
      streamEnded: false, stopped: false,
    };
    run = r;
    state.runs += 1;
    Object.assign(state, {
      error: null, requestStart: performance.now(), firstChunkAt: null, doneAt: null, ttfaMs: null,
      elapsedMs: null, chunks: 0, samples: 0, bytes: 0, sampleRate: null, seed: null, requestId: null,
      underruns: 0, playedAtDoneS: null, playing: false,
    });
    clearError();
    resetDownloads();
    drawWave(null);
    updateStats();
    ui.generate.disabled = true;
    ui.stop.disabled = false;
    setStatus('running', 'Requesting…');
    try {
      await ensureContext();
      const { body, shown } = await buildBody();
      r.body = body;
      state.request = shown;
      const resp = await fetch('v1/tts', {
        method: 'POST', cache: 'no-store', signal: r.controller.signal, body: JSON.stringify(body),
        headers: { 'Content-Type': 'application/json', ...authHeaders() },
      });
      if (!resp.ok) throw await apiError(resp);
      r.rate = parseInt(resp.headers.get('X-Shoal-Sample-Rate') || '', 10)
        || body.sample_rate || (readyInfo && readyInfo.sample_rate) || 44100;
      state.sampleRate = r.rate;
      state.seed = resp.headers.get('X-Shoal-Seed');
      state.requestId = resp.headers.get('X-Request-Id');
      setStatus('running', ctx.state === 'running'
        ? 'Streaming…' : 'Streaming… (the browser holds the audio back: click the page to let it play)');
      const reader = resp.body.getReader();
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        if (r !== run || r.stopped) return;
        state.bytes += value.byteLength;
        const pcm = takeSamples(r, value);
        if (pcm.length && state.firstChunkAt === null) {
          state.firstChunkAt = performance.now();
          state.ttfaMs = state.firstChunkAt - state.requestStart;
        }
        schedule(r, pcm);
        state.elapsedMs = performance.now() - state.requestStart;
        updateStats();
      }
      if (r !== run || r.stopped) return;
      r.streamEnded = true;
      state.doneAt = performance.now();
      state.elapsedMs = state.doneAt - state.requestStart;
      state.playedAtDoneS = r.audioStart === null ? 0 : Math.max(0, ctx.currentTime - r.audioStart);
      if (r.carry) console.warn('shoal playground: the stream ended on half a sample');
      updateStats();
      offerDownloads(r, false);
      const dur = state.samples / r.rate;
      setStatus('done', state.samples
        ? `Done: ${fmtSeconds(dur)} of audio in ${fmtSeconds(state.elapsedMs / 1000)}.`
        : 'Done: the server sent no audio.');
      if (!r.sources.size) {
        state.playing = false;
        ui.stop.disabled = true;
      }
    } catch (err) {
      if (r !== run) return;
      r.streamEnded = true;
      if (r.stopped || (err && err.name === 'AbortError')) return; // stop() reported it
      state.doneAt = performance.now();
      showError(err);
      setStatus('error', 'Failed.');
      offerDownloads(r, true); // what arrived before a cut keeps playing
      if (!r.sources.size) ui.stop.disabled = true;
    } finally {
      if (r === run) ui.generate.disabled = false;
    }
  }

  function stop() {
    const r = run;
    if (!r) return;
    const streaming = !r.streamEnded;
    r.stopped = true;
    r.streamEnded = true;
    r.controller.abort();
    stopSources(r);
    ui.stop.disabled = true;
    ui.generate.disabled = false;
    if (streaming) {
      state.doneAt = performance.now();
      setStatus('stopped', `Stopped after ${fmtSeconds(state.samples / (r.rate || 1))} of audio.`);
      offerDownloads(r, true);
    }
  }

  // ------------------------------------------------------------------ server info
  async function checkReady() {
    try {
      const resp = await fetch('v1/ready', { cache: 'no-store' });
      if (resp.ok) {
        readyInfo = await resp.json();
        ui.server.textContent = `Ready · ${readyInfo.model_family || 'model'} · ${readyInfo.sample_rate} Hz`;
        ui.server.dataset.state = 'ready';
        return;
      }
      ui.server.textContent = resp.status === 503 ? 'Warming up…' : `Server answered ${resp.status}`;
    } catch (_) {
      ui.server.textContent = 'Server unreachable; retrying…';
    }
    ui.server.dataset.state = 'waiting';
    setTimeout(checkReady, 2000);
  }

  // The voice library (GET /model, Fish's "list models"); absent on servers without one.
  async function loadVoices() {
    const keep = ui.voice.value;
    while (ui.voice.options.length > 1) ui.voice.remove(1);
    ui.voiceNote.textContent = '';
    try {
      const resp = await fetch('model?page_size=100', { cache: 'no-store', headers: authHeaders() });
      if (resp.status === 404 || resp.status === 501) {  // 501: server started without --voices-dir
        ui.voiceNote.textContent = 'no voice library on this server';
        return;
      }
      if (resp.status === 401 || resp.status === 403) {  // listed again when the key changes
        ui.voiceNote.textContent = 'enter the API key to list voices';
        return;
      }
      if (!resp.ok) {
        const err = await apiError(resp);
        ui.voiceNote.textContent = `voice list: ${err.status} ${err.message}`;
        return;
      }
      const data = await resp.json();
      const items = Array.isArray(data) ? data : (data && Array.isArray(data.items) ? data.items : []);
      for (const item of items) {
        const id = item && (item._id || item.id);
        if (!id) continue;
        ui.voice.add(new Option(item.title || item.name || id, id));
      }
      if ([...ui.voice.options].some((o) => o.value === keep)) ui.voice.value = keep;
      ui.voiceNote.textContent = items.length ? `${items.length} voice(s)` : 'the voice library is empty';
    } catch (_) {
      ui.voiceNote.textContent = 'voice list unavailable';
    }
  }

  // ------------------------------------------------------------------ wiring
  ui.form.addEventListener('submit', (e) => {
    e.preventDefault();
    generate();
  });
  ui.text.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      if (!ui.generate.disabled) generate();
    }
  });
  document.addEventListener('pointerdown', () => { // a gesture lets held-back audio play
    if (ctx && ctx.state === 'suspended') ctx.resume();
  });
  ui.stop.addEventListener('click', stop);
  ui.downloadEncoded.addEventListener('click', downloadEncoded);
  ui.refClear.addEventListener('click', () => { ui.refAudio.value = ''; ui.refText.value = ''; });
  ui.temperature.addEventListener('input', () => { ui.temperatureOut.textContent = ui.temperature.value; });
  ui.topP.addEventListener('input', () => { ui.topPOut.textContent = ui.topP.value; });
  ui.apiKey.addEventListener('change', loadVoices);
  ui.format.addEventListener('change', () => {
    if (run && run.streamEnded && !run.stopped && state.status === 'done') {
      resetDownloads();
      offerDownloads(run, false);
    }
  });

  window.shoalPlayground = {
    state, generate, stop, loadVoices,
    downloadBlob: async () => downloadBlob, // what the download link holds (null before a result)
  };
  drawWave(null);
  checkReady();
  loadVoices();
})();
