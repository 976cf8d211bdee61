#include "server/download.h"

#include <curl/curl.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"

fitm_status fitm_download_file(const char *url, const char *path, fitm_err *err)
{
    char part[4096];
    if (snprintf(part, sizeof part, "%s.part", path) >= (int)sizeof part)
        return fitm_err_set(err, FITM_ERR_INVALID, "model path too long");
    FILE *f = fopen(part, "wb");
    if (!f)
        return fitm_err_set(err, FITM_ERR_IO, "cannot write %s: %s", part, strerror(errno));
    fitm_status st = FITM_OK;
    CURL *c = curl_easy_init();
    if (!c) {
        fclose(f);
        unlink(part);
        return fitm_err_set(err, FITM_ERR_IO, "cannot start libcurl");
    }
    char cerr[CURL_ERROR_SIZE] = "";
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, f); /* default write callback: fwrite */
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(c, CURLOPT_MAXREDIRS, 10L);
    curl_easy_setopt(c, CURLOPT_FAILONERROR, 1L);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, cerr);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, 30L);
    curl_easy_setopt(c, CURLOPT_USERAGENT, "fitmd");
    FITM_LOG(FITM_LOG_INFO, NULL, "downloading %s to %s", url, path);
    CURLcode rc = curl_easy_perform(c);
    long code = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(c);
    if (fclose(f) != 0 && rc == CURLE_OK)
        st = fitm_err_set(err, FITM_ERR_IO, "writing %s: %s", part, strerror(errno));
    if (rc != CURLE_OK)
        st = fitm_err_set(err, FITM_ERR_IO, "download %s failed (HTTP %ld): %s", url, code,
                          cerr[0] ? cerr : curl_easy_strerror(rc));
    if (st == FITM_OK && rename(part, path) != 0)
        st = fitm_err_set(err, FITM_ERR_IO, "cannot rename %s to %s: %s", part, path,
                          strerror(errno));
    if (st != FITM_OK)
        unlink(part);
    return st;
}
