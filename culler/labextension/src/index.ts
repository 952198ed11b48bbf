/**
 * Shows the gpufleet controller's notices about this session ("idle for 45 min, will be
 * stopped at 14:02") as JupyterLab notifications, with a "Keep alive 1 hour" action, and
 * tells the session when its user typed, clicked or scrolled here.
 *
 * The notices come from the server extension gpufleet.culler.session_extension
 * (GET gpufleet/notices); the action POSTs gpufleet/keep-alive. Each notice id is shown once;
 * a notice the controller withdraws (after a keep-alive, say) is dismissed. A notice longer
 * than a notification holds is shown whole, as several, split between its sentences.
 *
 * Input: at each look for notices, if the user pressed a key, a pointer or the wheel since
 * the last one, POST gpufleet/input {"seconds_ago": s}. That is use, for the idle culler;
 * the page's own requests (this one's polling included) are not.
 */
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { Notification } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

// Until the server extension says how often (poll_s, from the project's warning time).
const DEFAULT_POLL_MS = 10_000;
const MIN_POLL_MS = 1_000;
const KEEP_ALIVE_HOURS = 1;
// JupyterLab cuts a notification's message at 140 characters, with "…", in the toast and
// in the notification centre alike.
const NOTIFICATION_CHARS = 140;
const INPUT_EVENTS = ['keydown', 'pointerdown', 'wheel'];

/**
 * ``message`` as parts of at most ``limit`` characters, whole sentences together where they
 * fit; a sentence longer than that is split between words.
 */
function splitMessage(
  message: string,
  limit: number = NOTIFICATION_CHARS
): string[] {
  const sentences = message.trim().split(/(?<=[.!?])\s+/);
  const parts: string[] = [];
  let part = '';
  const add = (text: string): void => {
    const joined = part ? `${part} ${text}` : text;
    if (joined.length <= limit) {
      part = joined;
      return;
    }
    if (part) {
      parts.push(part);
    }
    part = text;
  };
  for (const sentence of sentences.filter(s => s)) {
    if (sentence.length <= limit) {
      add(sentence);
      continue;
    }
    for (const word of sentence.split(/\s+/)) {
      for (let at = 0; at < word.length; at += limit) {
        add(word.slice(at, at + limit));
      }
    }
  }
  if (part) {
    parts.push(part);
  }
  return parts;
}

interface ISessionNotice {
  id: string;
  level: 'info' | 'warning' | 'error';
  message: string;
  deadline: string | null;
}

interface INoticesReply {
  notices: ISessionNotice[];
  keep_alive_until: string | null;
  keep_alive_max_s: number | null;
  poll_s?: number;
}

class SessionNotices {
  constructor(private readonly settings: ServerConnection.ISettings) {}

  /** Polls now and then every pollMs while the server has the gpufleet extension. */
  start(): void {
    const touched = (): void => {
      this.inputAt = performance.now();
    };
    for (const kind of INPUT_EVENTS) {
      document.addEventListener(kind, touched, { capture: true, passive: true });
    }
    const tick = async (): Promise<void> => {
      let again = true;
      try {
        await this.reportInput();
        again = await this.poll();
      } catch (reason) {
        console.warn('gpufleet: could not show the notices', reason);
      }
      if (again) {
        window.setTimeout(tick, this.pollMs);
      }
    };
    void tick();
  }

  /** Shows new notices, dismisses withdrawn ones; false when there is no extension. */
  async poll(): Promise<boolean> {
    let reply: INoticesReply;
    try {
      const response = await this.request('gpufleet/notices', { method: 'GET' });
      if (response.status === 404) {
        console.info('gpufleet: this server has no session extension; no notices');
        return false;
      }
      if (!response.ok) {
        console.warn(`gpufleet: notices answered ${response.status}`);
        return true;
      }
      reply = (await response.json()) as INoticesReply;
    } catch (reason) {
      console.warn('gpufleet: could not fetch notices', reason);
      return true;
    }
    if (typeof reply.poll_s === 'number' && Number.isFinite(reply.poll_s)) {
      this.pollMs = Math.max(MIN_POLL_MS, reply.poll_s * 1000);
    }
    const notices = Array.isArray(reply.notices) ? reply.notices : [];
    const current = new Set(notices.map(notice => notice.id));
    for (const [noticeId, notificationIds] of this.active) {
      if (!current.has(noticeId)) {
        notificationIds.forEach(id => Notification.dismiss(id));
        this.active.delete(noticeId);
      }
    }
    for (const notice of notices) {
      if (!this.seen.has(notice.id)) {
        this.seen.add(notice.id);
        this.active.set(notice.id, this.show(notice));
      }
    }
    return true;
  }

  /** Tells the session when its user last typed, clicked or scrolled, if they did. */
  private async reportInput(): Promise<void> {
    const at = this.inputAt;
    if (at === null || at === this.inputSent) {
      return;
    }
    const secondsAgo = Math.max(0, (performance.now() - at) / 1000);
    try {
      const response = await this.request('gpufleet/input', {
        method: 'POST',
        body: JSON.stringify({ seconds_ago: secondsAgo })
      });
      if (response.ok) {
        this.inputSent = at;
      }
    } catch (reason) {
      console.warn('gpufleet: could not report input', reason);
    }
  }

  /** The notice as notifications: one, or its parts with the first on top. */
  private show(notice: ISessionNotice): string[] {
    const actions: Notification.IAction[] = [];
    if (notice.level === 'warning' || notice.deadline !== null) {
      actions.push({
        label: `Keep alive ${KEEP_ALIVE_HOURS} hour`,
        caption: 'Ask gpufleet to keep this session running for another hour',
        displayType: 'accent',
        callback: () => void this.keepAlive(KEEP_ALIVE_HOURS)
      });
    }
    const parts = splitMessage(notice.message);
    // The newest notification is shown on top, in the toasts and in the centre alike.
    return parts
      .map((part, index) => ({ part, index }))
      .reverse()
      .map(({ part, index }) =>
        Notification.emit(part, notice.level, {
          autoClose: false,
          actions: index === 0 ? actions : []
        })
      )
      .reverse();
  }

  private async keepAlive(hours: number): Promise<void> {
    let message: string;
    try {
      const response = await this.request('gpufleet/keep-alive', {
        method: 'POST',
        body: JSON.stringify({ hours })
      });
      const body = await response.json().catch(() => ({}));
      if (response.ok) {
        const until = body.keep_alive_until
          ? new Date(body.keep_alive_until).toLocaleTimeString([], {
              hour: '2-digit',
              minute: '2-digit'
            })
          : null;
        Notification.success(
          until
            ? `This session will be kept running until ${until}.`
            : 'This session will be kept running.',
          { autoClose: 8000 }
        );
        await this.poll();
        return;
      }
      message =
        body.message ?? `Keep-alive failed (the server answered ${response.status}).`;
    } catch (reason) {
      message = `Keep-alive failed: ${reason}`;
    }
    Notification.error(message, { autoClose: false });
  }

  private request(path: string, init: RequestInit): Promise<Response> {
    const url = URLExt.join(this.settings.baseUrl, path);
    return ServerConnection.makeRequest(url, init, this.settings);
  }

  private pollMs = DEFAULT_POLL_MS;
  private inputAt: number | null = null; // performance.now() of the last input
  private inputSent: number | null = null; // the input the session was last told of
  private readonly seen = new Set<string>();
  private readonly active = new Map<string, string[]>();
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: '@gpufleet/session-notices:plugin',
  description: "Shows the gpufleet controller's notices about this session.",
  autoStart: true,
  activate: (app: JupyterFrontEnd): void => {
    // Toasts emitted before the shell is restored land in the notification centre only.
    const notices = new SessionNotices(app.serviceManager.serverSettings);
    void app.restored.then(() => notices.start());
  }
};

export default plugin;
