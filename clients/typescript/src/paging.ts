import type { Page } from "./models.js";

/**
 * A listing, fetched a page at a time as it is read: `for await (const q of pager)`
 * walks every item; `pager.pages()` walks the pages (each with its nextPageToken, to
 * resume later from a token).
 */
export class Pager<T> implements AsyncIterable<T> {
  readonly #fetch: (token: string) => Promise<Page<T>>;
  readonly #start: string;

  constructor(fetch: (token: string) => Promise<Page<T>>, pageToken = "") {
    this.#fetch = fetch;
    this.#start = pageToken;
  }

  async *pages(): AsyncGenerator<Page<T>, void, undefined> {
    let token = this.#start;
    for (;;) {
      const page = await this.#fetch(token);
      yield page;
      if (!page.nextPageToken) return;
      token = page.nextPageToken;
    }
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<T, void, undefined> {
    for await (const page of this.pages()) yield* page.items;
  }

  /** Every item of every page, in one array. */
  async toArray(): Promise<T[]> {
    const out: T[] = [];
    for await (const item of this) out.push(item);
    return out;
  }
}
