/* download: fetches a model file over http(s) with libcurl (fitmd's model_url). */
#ifndef FITM_DOWNLOAD_H
#define FITM_DOWNLOAD_H

#include "base/status.h"

/* Downloads url to path: into "path.part" first, renamed to path only when complete, so a
 * broken download never looks like a model. Follows redirects; any status other than 2xx is an
 * error (FITM_ERR_IO) naming the URL and status. Blocks until done. */
fitm_status fitm_download_file(const char *url, const char *path, fitm_err *err);

#endif
