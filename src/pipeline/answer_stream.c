/* answer_stream: the answer's text as it grows, token piece by piece: the stop strings (cut
 * where one ends; bytes that could begin one held back) and what is handed to on_delta
 * (whole UTF-8 characters only), for a streamed answer's Server-Sent Events. */
#include "pipeline/answer_internal.h"

#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer.h"

fitm_status fitm_answer_text_append(fitm_answer_text *t, const char *s, size_t n, fitm_err *err)
{
    if (t->n + n + 1 > t->cap) {
        size_t cap = (t->cap + n + 1) * 2;
        char *v = realloc(t->v, cap);
        if (!v)
            return fitm_err_set(err, FITM_ERR_NOMEM, "out of memory for the answer text");
        t->v = v;
        t->cap = cap;
    }
    memcpy(t->v + t->n, s, n);
    t->n += n;
    t->v[t->n] = '\0';
    return FITM_OK;
}

bool fitm_answer_text_cut_at_stop(const fitm_answer_request *req, fitm_answer_text *t, size_t n_new)
{
    size_t best = (size_t)-1;
    for (int32_t i = 0; i < req->n_stop; i++) {
        size_t sl = strlen(req->stop[i]);
        size_t from = t->n >= n_new + sl ? t->n - n_new - sl + 1 : 0;
        for (size_t j = from; j + sl <= t->n && j < best; j++)
            if (!memcmp(t->v + j, req->stop[i], sl)) {
                best = j;
                break;
            }
    }
    if (best == (size_t)-1)
        return false;
    t->n = best;
    t->v[best] = '\0';
    if (t->sent > best)
        t->sent = best; /* cannot happen: held-back bytes cover every stop prefix */
    return true;
}

/* Bytes at the end of the text that could begin a stop string: not sent yet. */
static size_t held_back(const fitm_answer_request *req, const fitm_answer_text *t)
{
    size_t hold = 0;
    for (int32_t i = 0; i < req->n_stop; i++) {
        size_t sl = strlen(req->stop[i]);
        for (size_t l = sl - 1; l > hold; l--)
            if (l <= t->n && !memcmp(t->v + t->n - l, req->stop[i], l)) {
                hold = l;
                break;
            }
    }
    return hold;
}

fitm_status fitm_answer_text_flush(const fitm_answer_request *req, fitm_answer_text *t, bool final,
                                   fitm_answer_on_delta on_delta, void *arg, fitm_err *err)
{
    size_t end = t->n;
    if (!final) {
        end -= held_back(req, t);
        if (end < t->sent)
            end = t->sent;
        end = t->sent + fitm_tok_utf8_complete(t->v + t->sent, end - t->sent);
    }
    if (end == t->sent) /* nothing to send: still ask, so a gone client stops us */
        return final || !on_delta || on_delta(arg, "", 0)
                   ? FITM_OK
                   : fitm_err_set(err, FITM_ERR_CANCELLED, "the client went away");
    bool go_on = !on_delta || on_delta(arg, t->v + t->sent, end - t->sent);
    t->sent = end;
    return go_on ? FITM_OK : fitm_err_set(err, FITM_ERR_CANCELLED, "the client went away");
}

fitm_status fitm_answer_stopped(fitm_err *err)
{
    return fitm_err_set(err, FITM_ERR_TIMEOUT,
                        "stopped: the request's deadline passed or the server is shutting down");
}
